/* packd as XNNPACK's weights cache: fills XNNPACK's `struct xnn_weights_cache_provider`
 * with a packd-backed cache (packd.h: packd_xnn_cache_create).
 *
 * Include it after the engine's own <xnnpack.h>: the provider is filled for the layout that
 * header declares, which is the engine's. Three interfaces are known, told apart at compile
 * time by the sizes of the two structs (XNNPACK has no version macro):
 *
 *   interface            look-up key                               provider
 *   2024-11 (Debian 13)  {seed, kernel, bias}                      context + 6 callbacks
 *   2025-11              {seed, kernel, bias, fingerprint_id}      context + 6 callbacks
 *   2026-03 (current)    {seed, kernel, bias, fingerprint_id}      context + 7 (alias_data)
 *
 * PACKD_XNN_INTERFACE is then 202411, 202511 or 202603. Any other layout fails to compile
 * here instead of being guessed at: a key field packd does not read could make two weights
 * look alike, and a callback it does not fill would be called through garbage.
 *
 *   PackdXnnOptions o = {0};
 *   o.model = source_blake3;          // the model's packd source digest (see INTEGRATION.md)
 *   o.engine_symbol = (const void*)&xnn_create_runtime_v4;
 *   PackdXnnCache* cache; packd_xnn_cache_create(client, &o, &cache);
 *   struct xnn_weights_cache_provider provider;
 *   packd_xnn_fill_provider(cache, &provider);
 *   xnn_create_runtime_v4(subgraph, &provider, NULL, threadpool, 0, &runtime);
 *   packd_xnn_cache_finalize(cache);  // after every runtime creation; publishes if it built
 *   ...
 *   xnn_delete_runtime(runtime); packd_xnn_cache_free(cache);
 *
 * Never pass the provider to xnn_finalize_weights_cache or xnn_delete_weights_cache: they
 * take XNNPACK's own cache object. */
#ifndef PACKD_XNNPACK_H
#define PACKD_XNNPACK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "packd.h"

#ifndef XNN_EXTRA_BYTES
#error "include the engine's <xnnpack.h> before packd_xnnpack.h"
#endif

#ifdef __cplusplus
#define PACKD_XNN_STATIC_ASSERT static_assert
#else
#define PACKD_XNN_STATIC_ASSERT _Static_assert
#endif

/* Every known key starts {uint32_t seed; const void* kernel; const void* bias;}; the newer
 * ones end with uint32_t fingerprint_id right after bias (padded to pointer alignment). */
#define PACKD_XNN__KEY_V1 (offsetof(struct xnn_weights_cache_look_up_key, bias) + sizeof(const void*))
#define PACKD_XNN__KEY_V2 (PACKD_XNN__KEY_V1 + sizeof(void*))
PACKD_XNN_STATIC_ASSERT(offsetof(struct xnn_weights_cache_look_up_key, seed) == 0 &&
                            offsetof(struct xnn_weights_cache_look_up_key, kernel) == sizeof(void*) &&
                            offsetof(struct xnn_weights_cache_look_up_key, bias) == 2 * sizeof(void*),
                        "this xnnpack.h's look-up key is not {seed, kernel, bias, ...}: an interface packd does "
                        "not know");
PACKD_XNN_STATIC_ASSERT(sizeof(struct xnn_weights_cache_look_up_key) == PACKD_XNN__KEY_V1 ||
                            sizeof(struct xnn_weights_cache_look_up_key) == PACKD_XNN__KEY_V2,
                        "this xnnpack.h's look-up key has fields packd does not know (it knows XNNPACK 2024-11 "
                        "and the fingerprint_id of 2025-11)");
/* The provider: context, then look_up, reserve_space, look_up_or_insert, is_finalized,
 * offset_to_addr, delete_cache, and (2026-03) alias_data. */
PACKD_XNN_STATIC_ASSERT(offsetof(struct xnn_weights_cache_provider, context) == 0 &&
                            offsetof(struct xnn_weights_cache_provider, look_up) == sizeof(void*) &&
                            offsetof(struct xnn_weights_cache_provider, reserve_space) == 2 * sizeof(void*) &&
                            offsetof(struct xnn_weights_cache_provider, look_up_or_insert) == 3 * sizeof(void*) &&
                            offsetof(struct xnn_weights_cache_provider, is_finalized) == 4 * sizeof(void*) &&
                            offsetof(struct xnn_weights_cache_provider, offset_to_addr) == 5 * sizeof(void*) &&
                            offsetof(struct xnn_weights_cache_provider, delete_cache) == 6 * sizeof(void*),
                        "this xnnpack.h's weights cache provider is not the one packd knows");
PACKD_XNN_STATIC_ASSERT(sizeof(struct xnn_weights_cache_provider) == 7 * sizeof(void*) ||
                            (sizeof(struct xnn_weights_cache_provider) == 8 * sizeof(void*) &&
                             sizeof(struct xnn_weights_cache_look_up_key) == PACKD_XNN__KEY_V2),
                        "this xnnpack.h's weights cache provider has callbacks packd does not know (it knows "
                        "XNNPACK 2024-11's six and 2026-03's alias_data)");

#define PACKD_XNN__HAS_FINGERPRINT (sizeof(struct xnn_weights_cache_look_up_key) == PACKD_XNN__KEY_V2)
#define PACKD_XNN__HAS_ALIAS (sizeof(struct xnn_weights_cache_provider) == 8 * sizeof(void*))
/* The interface this translation unit was compiled for (see the table above). */
#define PACKD_XNN_INTERFACE (PACKD_XNN__HAS_ALIAS ? 202603 : PACKD_XNN__HAS_FINGERPRINT ? 202511 : 202411)

/* The key's fingerprint_id (0 for 2024-11 keys, which have none). Read by offset: the field
 * cannot be named where the engine's header lacks it. */
static inline uint32_t packd_xnn__fingerprint(const struct xnn_weights_cache_look_up_key* key) {
  uint32_t fp = 0;
  if (PACKD_XNN__HAS_FINGERPRINT) memcpy(&fp, (const char*)key + PACKD_XNN__KEY_V1, sizeof fp);
  return fp;
}

static inline size_t packd_xnn__look_up(void* context, const struct xnn_weights_cache_look_up_key* key) {
  if (PACKD_XNN__HAS_FINGERPRINT)
    return packd_xnn_look_up2(context, key->seed, key->kernel, key->bias, packd_xnn__fingerprint(key));
  return packd_xnn_look_up(context, key->seed, key->kernel, key->bias);
}

static inline void* packd_xnn__reserve_space(void* context, size_t n) {
  return packd_xnn_reserve_space(context, n);
}

static inline size_t packd_xnn__look_up_or_insert(void* context, const struct xnn_weights_cache_look_up_key* key,
                                                  void* ptr, size_t size) {
  if (PACKD_XNN__HAS_FINGERPRINT)
    return packd_xnn_look_up_or_insert2(context, key->seed, key->kernel, key->bias, packd_xnn__fingerprint(key), ptr,
                                        size);
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

static inline enum xnn_status packd_xnn__alias_data(void* context, void* alias, void* original) {
  return packd_xnn_alias_data(context, alias, original) ? xnn_status_success : xnn_status_invalid_parameter;
}

/* Fills `provider` so that XNNPACK uses `cache`, for the interface of the engine's header. */
static inline void packd_xnn_fill_provider(PackdXnnCache* cache, struct xnn_weights_cache_provider* provider) {
  memset(provider, 0, sizeof *provider);
  provider->context = cache;
  provider->look_up = packd_xnn__look_up;
  provider->reserve_space = packd_xnn__reserve_space;
  provider->look_up_or_insert = packd_xnn__look_up_or_insert;
  provider->is_finalized = packd_xnn__is_finalized;
  provider->offset_to_addr = packd_xnn__offset_to_addr;
  provider->delete_cache = packd_xnn__delete_cache;
  if (PACKD_XNN__HAS_ALIAS) {
    /* alias_data (2026-03), the eighth pointer (asserted above); written by offset because
     * the member cannot be named where the engine's header lacks it. */
    enum xnn_status (*alias)(void*, void*, void*) = packd_xnn__alias_data;
    PACKD_XNN_STATIC_ASSERT(sizeof alias == sizeof(void*), "function pointers are not pointer-sized here");
    memcpy((char*)provider + 7 * sizeof(void*), &alias, sizeof alias);
  }
}

#endif /* PACKD_XNNPACK_H */
