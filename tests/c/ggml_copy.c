/* A stand-in for one copy of libggml-base, for packd-llama's tests of a process holding
 * two ggml copies: ggml's allocator answers TAG (which copy it is), and CALLER is code of
 * this copy that allocates through ggml's API. With -DSUPPORTED it also says it is the ggml
 * packd-llama supports (0.25.3) and has the functions packd-llama looks for, so packd-llama
 * acts for this copy (a CPU buffer type: nothing to repack). */
#include <stddef.h>

void *ggml_backend_buft_alloc_buffer(void *buft, size_t size) {
  (void)buft;
  (void)size;
  return (void *)TAG;
}

void *CALLER(size_t size) { return ggml_backend_buft_alloc_buffer(NULL, size); }

#ifdef SUPPORTED
const char *ggml_version(void) { return "0.25.3"; }
const char *ggml_backend_buft_name(void *buft) {
  (void)buft;
  return "CPU";
}
size_t ggml_nbytes(const void *tensor) {
  (void)tensor;
  return 0;
}
void *ggml_backend_cpu_buffer_type(void) { return NULL; }
#endif
