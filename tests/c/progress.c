/* Packs a model through the C ABI with a progress callback against a real daemon, and
 * prints what the callback saw: "progress CALLS FIRST_STAGE MAX_DONE TOTAL", then
 * "segment KEY SIZE". Usage: progress SOCKET_DIR MODEL_PATH */
#include <stdint.h>
#include <stdio.h>

#include "packd.h"

struct seen {
    int calls;
    int first;
    uint64_t max_done;
    uint64_t total;
};

static void on_progress(void *user_data, PackdProgressStage stage, uint64_t done, uint64_t total) {
    struct seen *s = user_data;
    if (s->calls == 0) {
        s->first = (int)stage;
    }
    s->calls++;
    if (done > s->max_done) {
        s->max_done = done;
    }
    if (total > s->total) {
        s->total = total;
    }
}

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
    struct seen seen = {0, 0, 0, 0};
    PackdModel *model = NULL;
    s = packd_pack_path_progress(client, argv[2], "identity", NULL, 0, on_progress, &seen, &model);
    if (s != PACKD_STATUS_OK) {
        printf("pack %s %s\n", packd_status_name(s), packd_last_error());
        return 1;
    }
    printf("progress %d %d %llu %llu\n", seen.calls, seen.first, (unsigned long long)seen.max_done,
           (unsigned long long)seen.total);
    size_t len = 0;
    packd_model_data(model, &len);
    printf("segment %s %zu\n", packd_model_key(model), len);
    packd_model_release(model);
    packd_client_free(client);
    return 0;
}
