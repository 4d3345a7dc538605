/* A C program that uses packd through libpackd_client: packs a safetensors model (or finds
 * it packed), lists its entries with a checksum of each one's bytes, looks a tensor up by
 * name, verifies the BLAKE3 digests, maps the model again by key and by an open fd, and
 * shows how an error reads.
 *
 *   cc -std=c11 packd_example.c $(pkg-config --cflags --libs packd-client) -o packd_example
 *   ./packd_example MODEL.safetensors [LAYOUT] [SOCKET_DIR]
 *
 * Without SOCKET_DIR the default applies ($PACKD_SOCKET_DIR, /run/packd, ...). */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "packd.h"

/* FNV-1a, 64 bits: a checksum the caller can compare without a BLAKE3 library. */
static uint64_t fnv1a(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

static int fail(const char *what, PackdStatus s) {
    fprintf(stderr, "%s: %s: %s\n", what, packd_status_name((int)s), packd_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.safetensors [LAYOUT] [SOCKET_DIR]\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    const char *layout = argc > 2 && argv[2][0] ? argv[2] : NULL; /* NULL: the default */
    const char *dir = argc > 3 ? argv[3] : NULL;

    PackdClient *client = NULL;
    PackdStatus s = packd_connect(dir, &client);
    if (s != PACKD_STATUS_OK) return fail("connect", s);

    PackdModel *model = NULL;
    s = packd_pack_path(client, path, layout, NULL, 0, &model);
    if (s != PACKD_STATUS_OK) return fail("pack", s);

    size_t size = 0;
    const uint8_t *data = packd_model_data(model, &size);
    size_t n = packd_model_entry_count(model);
    printf("segment %s %zu %zu\n", packd_model_key(model), size, n);
    for (size_t i = 0; i < n; i++) {
        PackdEntry e;
        s = packd_model_entry(model, i, &e);
        if (s != PACKD_STATUS_OK) return fail("entry", s);
        printf("entry %s %s %s [", e.name, e.layout, e.dtype);
        for (size_t d = 0; d < e.ndim; d++) printf(d ? ",%" PRIu64 : "%" PRIu64, e.shape[d]);
        printf("] %zu %s %016" PRIx64 " %s\n", e.length, e.blake3, fnv1a(e.data, e.length), e.bias ? e.bias : "-");
        if (e.data < data || e.data + e.length > data + size) {
            fprintf(stderr, "entry %s lies outside the mapping\n", e.name);
            return 1;
        }
    }

    if (n > 0) {
        PackdEntry first, found;
        packd_model_entry(model, 0, &first);
        s = packd_model_find(model, first.name, &found);
        if (s != PACKD_STATUS_OK) return fail("find", s);
        printf("find %s %s\n", found.name, found.data == first.data ? "same-bytes" : "other-bytes");
        /* Where the entry lies and what format it is, without parsing its key: set `size`
         * so that a newer library writes only the fields this program knows. */
        PackdEntryDetails details = {.size = sizeof details};
        s = packd_model_entry_details(model, 0, &details);
        if (s != PACKD_STATUS_OK) return fail("details", s);
        printf("details %" PRIu64 " v%" PRIu32 " %s %s\n", details.offset, details.layout_version,
               (const uint8_t *)packd_model_data(model, NULL) + details.offset == first.data ? "at-offset" : "elsewhere",
               details.plan);
    }
    s = packd_model_verify(model);
    if (s != PACKD_STATUS_OK) return fail("verify", s);
    printf("verify ok\n");

    /* The same segment again, by key: another mapping of the same shared memory. */
    PackdModel *again = NULL;
    s = packd_get(client, packd_model_key(model), &again);
    if (s != PACKD_STATUS_OK) return fail("get", s);
    size_t size2 = 0;
    const uint8_t *data2 = packd_model_data(again, &size2);
    printf("get %s\n", size2 == size && memcmp(data, data2, size) == 0 ? "same" : "different");
    packd_model_release(again);

    /* And by an open file descriptor (the caller keeps it). */
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    PackdModel *by_fd = NULL;
    s = packd_pack_fd(client, fd, layout, NULL, 0, &by_fd);
    close(fd);
    if (s != PACKD_STATUS_OK) return fail("pack_fd", s);
    printf("pack_fd %s\n", strcmp(packd_model_key(by_fd), packd_model_key(model)) == 0 ? "same-key" : "other-key");
    packd_model_release(by_fd);

    /* Errors are a status and a message. */
    PackdModel *none = NULL;
    s = packd_get(client, "b3:no-such-key", &none);
    printf("missing %s %s\n", packd_status_name((int)s), none == NULL ? "null" : "set");
    s = packd_model_entry(model, n, &(PackdEntry){0});
    printf("out-of-range %s: %s\n", packd_status_name((int)s), packd_last_error());

    packd_model_release(model);
    packd_client_free(client);
    return 0;
}
