/* An XNNPACK worker over packd: maps MiniLM's raw weights from packd (an identity segment),
 * builds an XNNPACK subgraph of all its fully-connected layers, creates the runtime with
 * packd's weights cache (or XNNPACK's own with --private, or none with --no-cache), runs a
 * fixed input through every layer and prints one JSON line. Run it through `minilm-fc`,
 * which builds it and starts it under the right loader.
 *
 *   worker --socket-dir DIR --model FILE --dtype f32|f16|qd8 [--private|--no-cache] [--hold S]
 *          [--identity-extra TEXT] [--pause-before-finalize S] [--finalize-when FILE]
 *
 * dtypes: f32 — the weights as packd maps them; f16 — f16 inference (XNNPACK converts);
 * qd8 — dynamically quantised activations with per-channel int8 weights this worker
 * quantises itself (and names, so packd can share XNNPACK's packing of them). */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <xnnpack.h>

#include "packd.h"
#include "packd_xnnpack.h"

#define BATCH 4
#define MAX_LAYERS 256

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* MINILM_FC_TIMING=1: each phase's end, in ms since main, on stderr. */
static void phase(double t0, const char* name) {
  static int on = -1;
  if (on < 0) on = getenv("MINILM_FC_TIMING") != NULL;
  if (on) fprintf(stderr, "minilm-fc: %8.3f ms %s\n", now_ms() - t0, name);
}

static void die(const char* what, const char* detail) {
  fprintf(stderr, "minilm-fc: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
  exit(1);
}

static void check(enum xnn_status s, const char* what) {
  if (s != xnn_status_success) {
    char code[32];
    snprintf(code, sizeof code, "xnn_status %d", (int)s);
    die(what, code);
  }
}

/* XNNPACK's own cache, wrapped to count what it is asked to pack (for --private). */
struct counting {
  struct xnn_weights_cache_provider* inner;
  uint64_t reserve_calls, bytes;
};
static size_t c_look_up(void* c, const struct xnn_weights_cache_look_up_key* k) {
  struct counting* w = c;
  return w->inner->look_up(w->inner->context, k);
}
static void* c_reserve(void* c, size_t n) {
  struct counting* w = c;
  w->reserve_calls++;
  w->bytes += (n + 63) / 64 * 64;
  return w->inner->reserve_space(w->inner->context, n);
}
static size_t c_insert(void* c, const struct xnn_weights_cache_look_up_key* k, void* p, size_t n) {
  struct counting* w = c;
  return w->inner->look_up_or_insert(w->inner->context, k, p, n);
}
static bool c_finalized(void* c) {
  struct counting* w = c;
  return w->inner->is_finalized(w->inner->context);
}
static void* c_addr(void* c, size_t o) {
  struct counting* w = c;
  return w->inner->offset_to_addr(w->inner->context, o);
}
static enum xnn_status c_delete(void* c) {
  (void)c;
  return xnn_status_success;
}

struct layer {
  const PackdEntry* w;
  const PackdEntry* b; /* or NULL */
  size_t n, k;
  uint32_t in_id, out_id;
  float* in;
  float* out;
  int8_t* q;       /* qd8: quantised weights */
  float* scales;   /* qd8: per-channel scales */
};

/* Per-output-channel symmetric int8 quantisation (round half away from zero). */
static void quantise(const float* w, size_t n, size_t k, int8_t* q, float* scales) {
  for (size_t r = 0; r < n; r++) {
    float amax = 0.0f;
    for (size_t c = 0; c < k; c++) amax = fmaxf(amax, fabsf(w[r * k + c]));
    float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    scales[r] = scale;
    for (size_t c = 0; c < k; c++) {
      float v = roundf(w[r * k + c] / scale);
      q[r * k + c] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
    }
  }
}

/* `n` as JSON into `out` (24 bytes), or null when the run has no such figure. */
static void json_count(char* out, int known, unsigned long long n) {
  if (known) {
    snprintf(out, 24, "%llu", n);
  } else {
    snprintf(out, 24, "null");
  }
}

int main(int argc, char** argv) {
  double t0 = now_ms();
  const char *dir = NULL, *model_path = NULL, *dtype = "f32", *identity_extra = "", *finalize_when = NULL;
  int private_cache = 0, no_cache = 0;
  double hold = 0, pause = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--socket-dir") && i + 1 < argc) dir = argv[++i];
    else if (!strcmp(argv[i], "--model") && i + 1 < argc) model_path = argv[++i];
    else if (!strcmp(argv[i], "--dtype") && i + 1 < argc) dtype = argv[++i];
    else if (!strcmp(argv[i], "--hold") && i + 1 < argc) hold = atof(argv[++i]);
    else if (!strcmp(argv[i], "--identity-extra") && i + 1 < argc) identity_extra = argv[++i];
    else if (!strcmp(argv[i], "--pause-before-finalize") && i + 1 < argc) pause = atof(argv[++i]);
    else if (!strcmp(argv[i], "--finalize-when") && i + 1 < argc) finalize_when = argv[++i];
    else if (!strcmp(argv[i], "--private")) private_cache = 1;
    else if (!strcmp(argv[i], "--no-cache")) no_cache = 1;
    else die("unknown argument (see --help in minilm-fc)", argv[i]);
  }
  if (!model_path) die("--model FILE is required", NULL);
  int f16 = !strcmp(dtype, "f16"), qd8 = !strcmp(dtype, "qd8");
  if (!f16 && !qd8 && strcmp(dtype, "f32")) die("--dtype must be f32, f16 or qd8", dtype);

  PackdClient* client;
  if (packd_connect(dir, &client) != PACKD_STATUS_OK) die("cannot connect to packd", packd_last_error());
  PackdModel* model;
  if (packd_pack_path(client, model_path, "identity", NULL, 0, &model) != PACKD_STATUS_OK)
    die("cannot map the model from packd", packd_last_error());
  const char* source = strchr(packd_model_key(model), ':') + 1; /* b3:<source>@plan:... */
  phase(t0, "connected, model mapped");

  /* The fully-connected layers: every 2-D F32 "*.weight" outside the embeddings. */
  static struct layer layers[MAX_LAYERS];
  static PackdEntry entries[4096];
  size_t count = packd_model_entry_count(model), nl = 0;
  if (count > 4096) die("too many entries", NULL);
  for (size_t i = 0; i < count; i++) packd_model_entry(model, i, &entries[i]);
  for (size_t i = 0; i < count && nl < MAX_LAYERS; i++) {
    const PackdEntry* e = &entries[i];
    size_t len = strlen(e->name);
    if (e->ndim != 2 || strcmp(e->dtype, "F32") || len < 7 || strcmp(e->name + len - 7, ".weight") ||
        strstr(e->name, "embeddings"))
      continue;
    struct layer* l = &layers[nl++];
    l->w = e;
    l->n = e->shape[0];
    l->k = e->shape[1];
    char bias[1024];
    snprintf(bias, sizeof bias, "%.*s.bias", (int)(len - 7), e->name);
    for (size_t j = 0; j < count; j++)
      if (!strcmp(entries[j].name, bias)) l->b = &entries[j];
  }
  if (nl == 0) die("no fully-connected layer in the model", model_path);

  check(xnn_initialize(NULL), "xnn_initialize");
  phase(t0, "xnn_initialize");
  xnn_subgraph_t subgraph;
  check(xnn_create_subgraph(2 * (uint32_t)nl, 0, &subgraph), "xnn_create_subgraph");
  for (size_t i = 0; i < nl; i++) {
    struct layer* l = &layers[i];
    size_t in_dims[2] = {BATCH, l->k}, out_dims[2] = {BATCH, l->n}, w_dims[2] = {l->n, l->k}, b_dims[1] = {l->n};
    l->in_id = (uint32_t)(2 * i);
    l->out_id = (uint32_t)(2 * i + 1);
    check(xnn_define_tensor_value(subgraph, xnn_datatype_fp32, 2, in_dims, NULL, l->in_id,
                                  XNN_VALUE_FLAG_EXTERNAL_INPUT, &l->in_id), "input");
    check(xnn_define_tensor_value(subgraph, xnn_datatype_fp32, 2, out_dims, NULL, l->out_id,
                                  XNN_VALUE_FLAG_EXTERNAL_OUTPUT, &l->out_id), "output");
    uint32_t w_id, b_id = XNN_INVALID_VALUE_ID, in = l->in_id;
    if (qd8) {
      l->q = malloc(l->n * l->k);
      l->scales = malloc((l->n + 16) * sizeof(float)); /* XNNPACK may read past the end */
      if (!l->q || !l->scales) die("out of memory", NULL);
      quantise((const float*)l->w->data, l->n, l->k, l->q, l->scales);
      check(xnn_define_channelwise_quantized_tensor_value(subgraph, xnn_datatype_qcint8, l->scales, 2, 0, w_dims,
                                                          l->q, XNN_INVALID_VALUE_ID, 0, &w_id), "qc8w weights");
      uint32_t q_id;
      check(xnn_define_dynamically_quantized_tensor_value(subgraph, xnn_datatype_qdint8, 2, 1, in_dims,
                                                          XNN_INVALID_VALUE_ID, 0, &q_id), "qd8 input");
      check(xnn_define_unary(subgraph, xnn_unary_convert, NULL, l->in_id, q_id, 0), "convert");
      in = q_id;
    } else {
      check(xnn_define_tensor_value(subgraph, xnn_datatype_fp32, 2, w_dims, l->w->data, XNN_INVALID_VALUE_ID, 0,
                                    &w_id), "weights");
    }
    if (l->b)
      check(xnn_define_tensor_value(subgraph, xnn_datatype_fp32, 1, b_dims, l->b->data, XNN_INVALID_VALUE_ID, 0,
                                    &b_id), "bias");
    check(xnn_define_fully_connected(subgraph, -INFINITY, INFINITY, in, w_id, b_id, l->out_id, 0), "fully connected");
    l->in = malloc(BATCH * l->k * sizeof(float) + XNN_EXTRA_BYTES);
    l->out = malloc(BATCH * l->n * sizeof(float));
    if (!l->in || !l->out) die("out of memory", NULL);
    for (size_t j = 0; j < BATCH * l->k; j++) l->in[j] = (float)((int)((j * 2654435761u + i * 40503u) % 2001) - 1000) / 1000.0f;
  }

  phase(t0, "subgraph defined");
  /* The weights cache. */
  PackdXnnCache* cache = NULL;
  struct xnn_weights_cache_provider provider, *xnn_own = NULL;
  struct counting counting = {0};
  if (!no_cache && !private_cache) {
    PackdXnnOptions o = {0};
    o.model = source;
    o.engine_symbol = (const void*)&xnn_create_runtime_v4;
    static char extra[512];
    snprintf(extra, sizeof extra, "inference=%s%s%s", dtype, identity_extra[0] ? ";" : "", identity_extra);
    o.extra = extra;
    if (packd_xnn_cache_create(client, &o, &cache) != PACKD_STATUS_OK)
      die("cannot create the packd weights cache", packd_last_error());
    if (qd8) {
      /* Name the quantised weights: the name stands for the weights, their scales (a
       * function of the same f32 weights) and the bias (qd8 keys carry no bias pointer). */
      for (size_t i = 0; i < nl; i++) {
        char name[2048];
        snprintf(name, sizeof name, "%s#qc8w-sym-v1;bias=%s", layers[i].w->key, layers[i].b ? layers[i].b->key : "-");
        packd_xnn_cache_name(cache, layers[i].q, layers[i].n * layers[i].k, name);
      }
    }
    packd_xnn_fill_provider(cache, &provider);
  } else if (private_cache) {
    check(xnn_create_weights_cache_with_size(1 << 20, &xnn_own), "xnn_create_weights_cache");
    counting.inner = xnn_own;
    provider = (struct xnn_weights_cache_provider){&counting, c_look_up, c_reserve, c_insert, c_finalized, c_addr, c_delete};
  }
  phase(t0, "weights cache created");
  xnn_runtime_t runtime;
  uint32_t flags = f16 ? XNN_FLAG_FORCE_FP16_INFERENCE : 0;
  check(xnn_create_runtime_v4(subgraph, no_cache ? NULL : &provider, NULL, NULL, flags, &runtime), "xnn_create_runtime");
  phase(t0, "runtime created");
  if (pause > 0) {
    /* For tests: a builder that is slow to publish (and can be killed meanwhile). */
    fprintf(stderr, "minilm-fc: pausing before finalize\n");
    struct timespec ts = {(time_t)pause, (long)((pause - (time_t)pause) * 1e9)};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
  }
  if (finalize_when) {
    /* For tests: finalize once FILE exists (at most a minute), an event the test controls. */
    for (int i = 0; i < 12000 && access(finalize_when, F_OK) != 0; i++) {
      struct timespec ts = {0, 5000000};
      nanosleep(&ts, NULL);
    }
  }
  if (cache && packd_xnn_cache_finalize(cache) != PACKD_STATUS_OK) die("finalize", packd_last_error());
  if (xnn_own) check(xnn_finalize_weights_cache(xnn_own, xnn_weights_cache_finalization_kind_soft), "finalize");
  phase(t0, "finalized");
  check(xnn_reshape_runtime(runtime), "xnn_reshape_runtime");
  struct xnn_external_value* ext = calloc(2 * nl, sizeof *ext);
  for (size_t i = 0; i < nl; i++) {
    ext[2 * i] = (struct xnn_external_value){layers[i].in_id, layers[i].in};
    ext[2 * i + 1] = (struct xnn_external_value){layers[i].out_id, layers[i].out};
  }
  check(xnn_setup_runtime_v2(runtime, 2 * nl, ext), "xnn_setup_runtime");
  double ready = now_ms() - t0;
  check(xnn_invoke_runtime(runtime), "xnn_invoke_runtime");

  size_t total = 0;
  for (size_t i = 0; i < nl; i++) total += BATCH * layers[i].n;
  float* all = malloc(total * sizeof(float));
  for (size_t i = 0, at = 0; i < nl; i++) {
    memcpy(all + at, layers[i].out, BATCH * layers[i].n * sizeof(float));
    at += BATCH * layers[i].n;
  }
  char digest[65];
  packd_blake3_hex((const uint8_t*)all, total * sizeof(float), digest);

  PackdXnnStats s = {0};
  if (cache) {
    packd_xnn_cache_wait(cache); /* the publication, if this worker built */
    packd_xnn_cache_stats(cache, &s);
  }
  /* A figure the run has no source for (no packd cache: no hits or misses; no cache at all:
     nothing reserved or packed) is null, never a number. */
  char hits[24], misses[24], reserve[24], packed[24], priv[24];
  json_count(hits, cache != NULL, cache ? s.hits : 0);
  json_count(misses, cache != NULL, cache ? s.misses : 0);
  json_count(reserve, cache != NULL || private_cache, cache ? s.reserve_space : counting.reserve_calls);
  json_count(packed, cache != NULL || private_cache, cache ? s.bytes_packed : counting.bytes);
  json_count(priv, cache != NULL || private_cache, cache ? s.bytes_private : counting.bytes);
  static const char* modes[] = {"served", "building", "published", "private"};
  printf("{\"hits\":%s,\"misses\":%s,\"reserve_space\":%s,\"bytes_packed\":%s,\"bytes_private\":%s,"
         "\"ready_ms\":%.3f,\"output_blake3\":\"%s\",\"layers\":%zu,\"dtype\":\"%s\",\"cache\":\"%s\","
         "\"bytes_shared\":%llu,\"unnamed\":%llu,\"pid\":%d}\n",
         hits, misses, reserve, packed, priv, ready, digest, nl, dtype,
         cache ? modes[s.mode & 3] : (private_cache ? "xnnpack" : "none"), (unsigned long long)s.bytes_shared,
         (unsigned long long)s.unnamed, (int)getpid());
  if (cache && s.mode == PACKD_XNN_MODE_PRIVATE) fprintf(stderr, "minilm-fc: private: %s\n", packd_xnn_cache_reason(cache));
  fflush(stdout);
  if (hold > 0) {
    struct timespec ts = {(time_t)hold, (long)((hold - (time_t)hold) * 1e9)};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
  }
  xnn_delete_runtime(runtime);
  xnn_delete_subgraph(subgraph);
  if (xnn_own) xnn_delete_weights_cache(xnn_own);
  packd_xnn_cache_free(cache);
  packd_model_release(model);
  packd_client_free(client);
  return 0;
}
