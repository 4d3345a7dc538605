/* Reports through the C ABI: one report kept while no client exists (packd "away"), then a
 * client connects and sends it with two of its own; bad values are refused. Prints one line
 * per call: "NAME STATUS". Usage: report SOCKET_DIR, then waits for a line on stdin (the
 * test reads the daemon meanwhile) before it exits. */
#include <stdint.h>
#include <stdio.h>

#include "packd.h"

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: report SOCKET_DIR\n");
        return 2;
    }
    PackdStatus s = packd_report(NULL, "c-engine", "away-model", PACKD_OBTAINED_PRIVATE,
                                 PACKD_FALLBACK_DAEMON_AWAY, "no daemon at start", 1000, 0);
    printf("later %s\n", packd_status_name(s));
    PackdClient *client = NULL;
    s = packd_connect(argv[1], &client);
    printf("connect %s\n", packd_status_name(s));
    if (s != PACKD_STATUS_OK) {
        return 1;
    }
    s = packd_report(client, "c-engine", "c-model", PACKD_OBTAINED_PRIVATE, PACKD_FALLBACK_ENGINE_CACHE,
                     "the engine brought its own cache", 2000, 0);
    printf("private %s\n", packd_status_name(s));
    s = packd_report(client, "c-engine", "shared-model", PACKD_OBTAINED_SERVED, PACKD_FALLBACK_NONE, NULL, 0, 4096);
    printf("served %s\n", packd_status_name(s));
    s = packd_report(client, "c-engine", "m", 7, PACKD_FALLBACK_NONE, NULL, 0, 0);
    printf("bad_obtained %s\n", packd_status_name(s));
    s = packd_report(client, "c-engine", "m", PACKD_OBTAINED_PRIVATE, 99, NULL, 0, 0);
    printf("bad_fallback %s\n", packd_status_name(s));
    s = packd_report(client, "c-engine", "m", PACKD_OBTAINED_PRIVATE, PACKD_FALLBACK_NONE, NULL, 0, 0);
    printf("no_reason %s\n", packd_status_name(s));
    s = packd_report(client, "c-engine", "m", PACKD_OBTAINED_SERVED, PACKD_FALLBACK_OVER_QUOTA, NULL, 0, 0);
    printf("served_with_reason %s\n", packd_status_name(s));
    fflush(stdout);
    char line[8];
    if (fgets(line, sizeof line, stdin) == NULL) {
        /* the test closed stdin: done */
    }
    packd_client_free(client);
    return 0;
}
