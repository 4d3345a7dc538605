/* packd as XNNPACK's weights cache: fills XNNPACK's `struct xnn_weights_cache_provider`
 * with a packd-backed cache (packd.h: packd_xnn_cache_create).
 *
 * Include it after the engine's own <xnnpack.h>: the struct is filled by name, compiled
 * against that header, so its layout is the engine's. It checks at compile time that the
 * provider interface is the one packd supports (XNNPACK 2024-11, as Debian trixie ships
 * it): a newer xnnpack.h whose look-up key has more fields (upstream added
 * `fingerprint_id`, Nov 2025) or whose provider has more callbacks (`alias_data`,
 * Mar 2026) fails to compile here instead of silently ignoring them — a key field packd
 * does not read could otherwise make two different weights look alike.
 *
 *   PackdXnnOptions o = {0};
 *   o.model = source_blake3;                       // changes whenever any weight does
 *   o.engine_symbol = (const void*)&xnn_create_runtime_v4;
 *   PackdXnnCache* cache; packd_xnn_cache_create(client, &o, &cache);
 *   struct xnn_weights_cache_provider provider;
 *   packd_xnn_fill_provider(cache, &provider);
 *   xnn_create_runtime_v4(subgraph, &provider, NULL, threadpool, 0, &runtime);
 *   packd_xnn_cache_finalize(cache);               // publishes, if this process built
 *   ...
 *   xnn_delete_runtime(runtime); packd_xnn_cache_free(cache);
 *
 * Never pass the provider to xnn_finalize_weights_cache or xnn_delete_weights_cache: they
 * take XNNPACK's own cache object. */
#ifndef PACKD_XNNPACK_H
#define PACKD_XNNPACK_H

#include <stddef.h>
#include "packd.h"

#ifndef XNN_EXTRA_BYTES
#error "include the engine's <xnnpack.h> before packd_xnnpack.h"
#endif

#ifdef __cplusplus
#define PACKD_XNN_STATIC_ASSERT static_assert
#else
#define PACKD_XNN_STATIC_ASSERT _Static_assert
#endif

/* The look-up key packd reads: { uint32_t seed; const void* kernel; const void* bias; }. */
PACKD_XNN_STATIC_ASSERT(sizeof(struct xnn_weights_cache_look_up_key) ==
                            offsetof(struct xnn_weights_cache_look_up_key, bias) + sizeof(const void*),
                        "this xnnpack.h has look-up key fields after bias (e.g. fingerprint_id): packd's "
                        "provider supports the 2024-11 interface only");
PACKD_XNN_STATIC_ASSERT(offsetof(struct xnn_weights_cache_look_up_key, kernel) == sizeof(void*),
                        "this xnnpack.h has look-up key fields between seed and kernel: unsupported");
/* The provider: context and six callbacks. */
PACKD_XNN_STATIC_ASSERT(sizeof(struct xnn_weights_cache_provider) == 7 * sizeof(void*),
                        "this xnnpack.h's weights cache provider has callbacks packd does not implement "
                        "(e.g. alias_data): packd's provider supports the 2024-11 interface only");

static inline size_t packd_xnn__look_up(void* context, const struct xnn_weights_cache_look_up_key* key) {
  return packd_xnn_look_up(context, key->seed, key->kernel, key->bias);
}

static inline void* packd_xnn__reserve_space(void* context, size_t n) {
  return packd_xnn_reserve_space(context, n);
}

static inline size_t packd_xnn__look_up_or_insert(void* context, const struct xnn_weights_cache_look_up_key* key,
                                                  void* ptr, size_t size) {
  return packd_xnn_look_up_or_insert(context, key->seed, key->kernel, key->bias, ptr, size);
}

static inline bool packd_xnn__is_finalized(void* context) { return packd_xnn_is_finalized(context); }

static inline void* packd_xnn__offset_to_addr(void* context, size_t offset) {
  return packd_xnn_offset_to_addr(context, offset);
}

static inline enum xnn_status packd_xnn__delete_cache(void* context) {
  (void)context; /* the cache is freed by packd_xnn_cache_free */
  return xnn_status_success;
}

/* Fills `provider` so that XNNPACK uses `cache`. */
static inline void packd_xnn_fill_provider(PackdXnnCache* cache, struct xnn_weights_cache_provider* provider) {
  provider->context = cache;
  provider->look_up = packd_xnn__look_up;
  provider->reserve_space = packd_xnn__reserve_space;
  provider->look_up_or_insert = packd_xnn__look_up_or_insert;
  provider->is_finalized = packd_xnn__is_finalized;
  provider->offset_to_addr = packd_xnn__offset_to_addr;
  provider->delete_cache = packd_xnn__delete_cache;
}

#endif /* PACKD_XNNPACK_H */
