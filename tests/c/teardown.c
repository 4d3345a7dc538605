/* Failing packd calls and packd_last_error() made while a thread ends, after the client
 * library's thread-locals are gone: from an atexit handler on the main thread and from a
 * pthread key destructor on another thread. Each must return (a status, a message that is
 * never NULL), never abort the process.
 *
 *   teardown          the atexit case
 *   teardown thread   the pthread key destructor case */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "packd.h"

static void fail_and_say(const char *where) {
  PackdModel *m = NULL;
  PackdStatus s = packd_get(NULL, "k", &m);
  const char *e = packd_last_error();
  printf("%s %s %s\n", where, packd_status_name(s), e ? e : "(NULL)");
  fflush(stdout);
}

static void at_exit(void) { fail_and_say("atexit"); }

static pthread_key_t key;
static void key_destructor(void *p) {
  (void)p;
  fail_and_say("key-destructor");
}

static void *worker(void *arg) {
  (void)arg;
  pthread_setspecific(key, (void *)1);
  fail_and_say("worker");
  return NULL;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "thread") == 0) {
    pthread_key_create(&key, key_destructor);
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    pthread_join(t, NULL);
    printf("joined\n");
    return 0;
  }
  atexit(at_exit);
  fail_and_say("main");
  return 0;
}
