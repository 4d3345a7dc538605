/* Loads two ggml copies (DIR/libggml-a.so, DIR/libggml-b.so, RTLD_LOCAL, as Python's ctypes
 * loads libraries) and allocates through each; with "later", copy B is loaded after copy A
 * was used and after packd_llama_enable() (when packd-llama is in the process) ran once.
 * Prints "A 0xa" and "B 0xb" when each copy's calls reached its own allocator.
 *
 *   two_ggml DIR [later] */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

static void *open_copy(const char *dir, const char *name) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
  return h;
}

typedef void *(*alloc_fn)(size_t);
typedef void (*enable_fn)(void);

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  int later = argc > 2 && strcmp(argv[2], "later") == 0;
  void *a = open_copy(argv[1], "libggml-a.so");
  void *b = later ? NULL : open_copy(argv[1], "libggml-b.so");
  if (!a || (!later && !b)) return 1;
  enable_fn enable;
  *(void **)&enable = dlsym(RTLD_DEFAULT, "packd_llama_enable");
  if (enable) enable();
  alloc_fn alloc_a, alloc_b;
  *(void **)&alloc_a = dlsym(a, "alloc_a");
  printf("A %p\n", alloc_a(4096));
  fflush(stdout);
  if (later) {
    b = open_copy(argv[1], "libggml-b.so");
    if (!b) return 1;
    if (enable) enable();
  }
  *(void **)&alloc_b = dlsym(b, "alloc_b");
  printf("B %p\n", alloc_b(4096));
  return 0;
}
