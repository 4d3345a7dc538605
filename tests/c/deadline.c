/* Calls packd through the C ABI against a daemon that never answers: every call must come
 * back with PACKD_STATUS_TIMEOUT. Prints one line per call: "<call> <status> <message>".
 * Usage: deadline SOCKET_DIR MODEL_PATH */
#include <stdio.h>

#include "packd.h"

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s SOCKET_DIR MODEL_PATH\n", argv[0]);
        return 2;
    }
    PackdClient *client = NULL;
    PackdStatus s = packd_connect(argv[1], &client);
    if (s != PACKD_STATUS_OK) {
        printf("connect %s %s\n", packd_status_name(s), packd_last_error());
        return 1;
    }
    s = packd_client_set_timeouts(client, 0, 200, 300);
    printf("set_timeouts %s\n", packd_status_name(s));
    PackdModel *model = NULL;
    s = packd_get(client, "b3:nothing@plan:0", &model);
    printf("get %s %s\n", packd_status_name(s), packd_last_error());
    s = packd_pack_path(client, argv[2], NULL, NULL, 0, &model);
    printf("pack %s %s\n", packd_status_name(s), packd_last_error());
    printf("model %s\n", model == NULL ? "null" : "set");
    packd_client_free(client);
    return 0;
}
