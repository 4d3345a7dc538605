/* A client and a model from before fork(), used in the child as the header says: the
 * child's calls go on a connection of its own (its replies are its own), and releasing the
 * inherited model there ends none of the parent's leases.
 *
 *   fork SOCKET_DIR MODEL   prints "parent KEY", "child same|other", "parent idle" once its
 *                           own packs are done, then waits for a line on stdin before it
 *                           exits (holding its model). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "packd.h"

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  PackdClient *c = NULL;
  PackdModel *held = NULL, *gemm = NULL;
  if (packd_connect(argv[1], &c) != PACKD_STATUS_OK) return 3;
  if (packd_pack_path(c, argv[2], "identity", NULL, 0, &held) != PACKD_STATUS_OK) return 4;
  if (packd_pack_path(c, argv[2], NULL, NULL, 0, &gemm) != PACKD_STATUS_OK) return 4;
  char gemm_key[512];
  snprintf(gemm_key, sizeof gemm_key, "%s", packd_model_key(gemm));
  packd_model_release(gemm);
  printf("parent %s\n", packd_model_key(held));
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    /* Packs in both processes at once: a reply that crossed would show the other key. */
    int same = 1;
    for (int i = 0; i < 200; i++) {
      PackdModel *m = NULL;
      if (packd_pack_path(c, argv[2], "identity", NULL, 0, &m) != PACKD_STATUS_OK) _exit(5);
      same &= strcmp(packd_model_key(m), packd_model_key(held)) == 0;
      packd_model_release(m);
    }
    packd_model_release(held);
    packd_client_free(c);
    printf("child %s\n", same ? "same" : "other");
    fflush(stdout);
    _exit(0);
  }
  int crossed = 0;
  for (int i = 0; i < 200; i++) {
    PackdModel *m = NULL;
    if (packd_pack_path(c, argv[2], NULL, NULL, 0, &m) != PACKD_STATUS_OK) return 6;
    crossed |= strcmp(packd_model_key(m), gemm_key) != 0;
    packd_model_release(m);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (crossed || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return 7;
  printf("parent idle\n");
  fflush(stdout);
  char line[8];
  if (!fgets(line, sizeof line, stdin)) return 8;
  packd_model_release(held);
  packd_client_free(c);
  return 0;
}
