/* One XNNPACK operator over packd's weights cache: the conformance worker.
 *
 * Maps a model's raw weights from packd (an identity segment: the `ops-model` tensors the
 * test writes), defines a subgraph of one operator with them, creates the runtime with
 * packd's weights cache (or XNNPACK's own with --private, or none with --no-cache), runs a
 * fixed input and prints one JSON line with the cache's counters and the output's BLAKE3.
 * Run it through `ops-worker`, which builds it and starts it under the right loader.
 *
 *   ops --socket-dir DIR --model FILE --op OP [--private|--no-cache] [--unnamed]
 *       [--finalize-when FILE] [--hold S] [--no-amx]
 *   ops --socket-dir DIR --reuse A B OP        (A, B, A again through one cache)
 *   ops --list
 *
 * --unnamed copies the weights into private memory first (nothing can name them).
 * --no-amx (x86_64) denies the process Intel AMX before XNNPACK starts: the permission
 * request XNNPACK makes (arch_prctl(ARCH_REQ_XCOMP_PERM)) fails, so it picks its AVX-512
 * kernels. XNNPACK 2024-11 as Debian built it computes garbage on CPUs with AMX in its AMX
 * qd8-f32-qc4w GEMM (the weights it unpacks onto the stack are never stored before the
 * tile load reads them: GCC's _tile_loadd has no memory clobber), for k >= 64. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <xnnpack.h>

#if defined(__x86_64__)
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#endif

#include "packd.h"
#include "packd_xnnpack.h"

static void die(const char* what, const char* detail) {
  fprintf(stderr, "ops: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
  exit(1);
}

static void check(enum xnn_status s, const char* what) {
  if (s != xnn_status_success) {
    char code[32];
    snprintf(code, sizeof code, "xnn_status %d", (int)s);
    die(what, code);
  }
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* Makes arch_prctl(ARCH_REQ_XCOMP_PERM, ...) fail with EPERM in this process: no AMX. */
static void deny_amx(void) {
#if defined(__x86_64__)
  struct sock_filter f[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_arch_prctl, 0, 3),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {sizeof f / sizeof f[0], f};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
    die("--no-amx", strerror(errno));
  }
#endif
}

/* The operators: name, what XNNPACK's cache does with it (documented in INTEGRATION.md). */
static const char* OPS[] = {"conv-f32", "conv-f16",   "conv-grouped-f32", "conv1x1-f32", "conv-qs8",
                            "conv-qd8", "dwconv-f32", "deconv-f32",       "fc-f32",      "fc-f16",
                            "fc-qd8",   "fc-qs8",     "fc-qc4w",          "bmm-f32",     "prelu-f32",
                            "convnet-f32"};
#define NOPS (sizeof OPS / sizeof OPS[0])

static PackdModel* model;
static PackdEntry entries[256];
static size_t nentries;
static int unnamed;

/* A tensor of the model by name: its bytes (copied to private memory with --unnamed). */
static const void* tensor(const char* name, size_t* len) {
  for (size_t i = 0; i < nentries; i++) {
    if (strcmp(entries[i].name, name)) continue;
    if (len) *len = entries[i].length;
    if (!unnamed) return entries[i].data;
    void* copy = malloc(entries[i].length + 64);
    if (!copy) die("out of memory", NULL);
    memcpy(copy, entries[i].data, entries[i].length);
    return copy;
  }
  die("the model has no tensor", name);
  return NULL;
}

/* Per-channel scales, copied with room past the end (XNNPACK may read past the last). */
static float* scales(const char* name) {
  size_t len;
  const float* s = tensor(name, &len);
  float* copy = calloc(len / 4 + 16, sizeof(float));
  if (!copy) die("out of memory", NULL);
  memcpy(copy, s, len);
  return copy;
}

struct graph {
  xnn_subgraph_t sg;
  uint32_t in_id, out_id;
  size_t in_len, out_len; /* bytes */
  int in_q;               /* input is qint8 */
  uint32_t flags;         /* runtime flags */
};

static uint32_t value(struct graph* g, enum xnn_datatype t, size_t nd, const size_t* dims, const void* data,
                      uint32_t flags) {
  uint32_t id;
  check(xnn_define_tensor_value(g->sg, t, nd, dims, data, XNN_INVALID_VALUE_ID, flags, &id), "tensor");
  return id;
}

static uint32_t qvalue(struct graph* g, int32_t zp, float scale, size_t nd, const size_t* dims, uint32_t flags) {
  uint32_t id;
  check(xnn_define_quantized_tensor_value(g->sg, xnn_datatype_qint8, zp, scale, nd, dims, NULL, XNN_INVALID_VALUE_ID,
                                          flags, &id),
        "quantized tensor");
  return id;
}

static uint32_t cvalue(struct graph* g, enum xnn_datatype t, int32_t zp, const float* s, size_t nd, const size_t* dims,
                       const void* data) {
  uint32_t id;
  check(xnn_define_channelwise_quantized_tensor_value_v2(g->sg, t, zp, s, nd, 0, dims, data, XNN_INVALID_VALUE_ID, 0,
                                                         &id),
        "channelwise tensor");
  return id;
}

static size_t prod(size_t nd, const size_t* d) {
  size_t n = 1;
  for (size_t i = 0; i < nd; i++) n *= d[i];
  return n;
}

/* External f32 (or qint8) input and output of the given shapes. */
static void io(struct graph* g, size_t ni, const size_t* in, size_t no, const size_t* out, int q, int32_t izp,
               float is, int32_t ozp, float os) {
  uint32_t fi = XNN_VALUE_FLAG_EXTERNAL_INPUT, fo = XNN_VALUE_FLAG_EXTERNAL_OUTPUT;
  g->in_q = q;
  g->in_id = q ? qvalue(g, izp, is, ni, in, fi) : value(g, xnn_datatype_fp32, ni, in, NULL, fi);
  g->out_id = q ? qvalue(g, ozp, os, no, out, fo) : value(g, xnn_datatype_fp32, no, out, NULL, fo);
  g->in_len = prod(ni, in) * (q ? 1 : 4);
  g->out_len = prod(no, out) * (q ? 1 : 4);
}

/* The f32 input converted to dynamically quantised int8. */
static uint32_t qd8_input(struct graph* g, size_t nd, const size_t* dims) {
  uint32_t q;
  check(xnn_define_dynamically_quantized_tensor_value(g->sg, xnn_datatype_qdint8, nd, 1, dims, XNN_INVALID_VALUE_ID,
                                                      0, &q),
        "qd8 input");
  check(xnn_define_unary(g->sg, xnn_unary_convert, NULL, g->in_id, q, 0), "convert");
  return q;
}

/* The int32 bias of a qs8 node: scale[c] = input scale × weight scale[c]. */
static uint32_t qs8_bias(struct graph* g, const char* name, const float* wscale, size_t n, float is) {
  float* s = calloc(n + 16, sizeof(float));
  if (!s) die("out of memory", NULL);
  for (size_t c = 0; c < n; c++) s[c] = is * wscale[c];
  size_t dims[1] = {n};
  return cvalue(g, xnn_datatype_qcint32, 0, s, 1, dims, tensor(name, NULL));
}

static void conv(struct graph* g, const char* op) {
  const float inf = INFINITY;
  if (!strcmp(op, "conv-f32") || !strcmp(op, "conv-f16") || !strcmp(op, "conv-qd8")) {
    size_t in[4] = {1, 9, 9, 13}, out[4] = {1, 5, 5, 19}, w[4] = {19, 3, 3, 13}, b[1] = {19};
    io(g, 4, in, 4, out, 0, 0, 0, 0, 0);
    uint32_t x = g->in_id, wid;
    if (!strcmp(op, "conv-qd8")) {
      x = qd8_input(g, 4, in);
      wid = cvalue(g, xnn_datatype_qcint8, 0, scales("conv.qscale"), 4, w, tensor("conv.qweight", NULL));
    } else {
      wid = value(g, xnn_datatype_fp32, 4, w, tensor("conv.weight", NULL), 0);
    }
    uint32_t bid = value(g, xnn_datatype_fp32, 1, b, tensor("conv.bias", NULL), 0);
    check(xnn_define_convolution_2d(g->sg, 1, 1, 1, 1, 3, 3, 2, 2, 1, 1, 1, 13, 19, -inf, inf, x, wid, bid, g->out_id,
                                    0),
          "convolution");
    if (!strcmp(op, "conv-f16")) g->flags = XNN_FLAG_FORCE_FP16_INFERENCE;
  } else if (!strcmp(op, "conv-qs8")) {
    size_t in[4] = {1, 9, 9, 13}, out[4] = {1, 5, 5, 19}, w[4] = {19, 3, 3, 13};
    io(g, 4, in, 4, out, 1, 3, 0.05f, -2, 0.2f);
    float* ws = scales("conv.qscale");
    uint32_t wid = cvalue(g, xnn_datatype_qcint8, 0, ws, 4, w, tensor("conv.qweight", NULL));
    uint32_t bid = qs8_bias(g, "conv.qbias", ws, 19, 0.05f);
    check(xnn_define_convolution_2d(g->sg, 1, 1, 1, 1, 3, 3, 2, 2, 1, 1, 1, 13, 19, -127.f * 0.2f, 127.f * 0.2f,
                                    g->in_id, wid, bid, g->out_id, 0),
          "convolution");
  } else if (!strcmp(op, "conv-grouped-f32")) {
    size_t in[4] = {1, 7, 7, 12}, out[4] = {1, 7, 7, 15}, w[4] = {15, 3, 3, 4}, b[1] = {15};
    io(g, 4, in, 4, out, 0, 0, 0, 0, 0);
    uint32_t wid = value(g, xnn_datatype_fp32, 4, w, tensor("gconv.weight", NULL), 0);
    uint32_t bid = value(g, xnn_datatype_fp32, 1, b, tensor("gconv.bias", NULL), 0);
    check(xnn_define_convolution_2d(g->sg, 1, 1, 1, 1, 3, 3, 1, 1, 1, 1, 3, 4, 5, -inf, inf, g->in_id, wid, bid,
                                    g->out_id, 0),
          "grouped convolution");
  } else if (!strcmp(op, "conv1x1-f32")) {
    size_t in[4] = {1, 6, 6, 32}, out[4] = {1, 6, 6, 24}, w[4] = {24, 1, 1, 32}, b[1] = {24};
    io(g, 4, in, 4, out, 0, 0, 0, 0, 0);
    uint32_t wid = value(g, xnn_datatype_fp32, 4, w, tensor("pw.weight", NULL), 0);
    uint32_t bid = value(g, xnn_datatype_fp32, 1, b, tensor("pw.bias", NULL), 0);
    check(xnn_define_convolution_2d(g->sg, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 32, 24, -inf, inf, g->in_id, wid, bid,
                                    g->out_id, 0),
          "1x1 convolution");
  } else if (!strcmp(op, "dwconv-f32")) {
    size_t in[4] = {1, 8, 8, 16}, out[4] = {1, 8, 8, 16}, w[4] = {1, 3, 3, 16}, b[1] = {16};
    io(g, 4, in, 4, out, 0, 0, 0, 0, 0);
    uint32_t wid = value(g, xnn_datatype_fp32, 4, w, tensor("dw.weight", NULL), 0);
    uint32_t bid = value(g, xnn_datatype_fp32, 1, b, tensor("dw.bias", NULL), 0);
    check(xnn_define_depthwise_convolution_2d(g->sg, 1, 1, 1, 1, 3, 3, 1, 1, 1, 1, 1, 16, -inf, inf, g->in_id, wid,
                                              bid, g->out_id, 0),
          "depthwise convolution");
  } else if (!strcmp(op, "deconv-f32")) {
    size_t in[4] = {1, 4, 4, 6}, out[4] = {1, 7, 7, 5}, w[4] = {5, 3, 3, 6}, b[1] = {5};
    io(g, 4, in, 4, out, 0, 0, 0, 0, 0);
    uint32_t wid = value(g, xnn_datatype_fp32, 4, w, tensor("deconv.weight", NULL), 0);
    uint32_t bid = value(g, xnn_datatype_fp32, 1, b, tensor("deconv.bias", NULL), 0);
    check(xnn_define_deconvolution_2d(g->sg, 1, 1, 1, 1, 0, 0, 3, 3, 2, 2, 1, 1, 1, 6, 5, -inf, inf, g->in_id, wid,
                                      bid, g->out_id, 0),
          "deconvolution");
  } else {
    die("unknown operator (see --list)", op);
  }
}

/* A small convolutional network (the benchmark's): 3×3 convolution 32→64, 3×3 depthwise,
 * 1×1 convolution 64→64 over 1×16×16×32, reshaped to 16×1024, then fully connected
 * 1024→768 and 768→3072. */
static void convnet(struct graph* g) {
  const float inf = INFINITY;
  size_t in[4] = {1, 16, 16, 32}, mid[4] = {1, 16, 16, 64}, flat[2] = {16, 1024}, out[2] = {16, 3072};
  io(g, 4, in, 2, out, 0, 0, 0, 0, 0);
  size_t cw[4] = {64, 3, 3, 32}, dw[4] = {1, 3, 3, 64}, pw[4] = {64, 1, 1, 64}, b64[1] = {64};
  size_t f1[2] = {768, 1024}, b1[1] = {768}, f2[2] = {3072, 768}, b2[1] = {3072}, h1[2] = {16, 768};
  uint32_t t1 = value(g, xnn_datatype_fp32, 4, mid, NULL, 0), t2 = value(g, xnn_datatype_fp32, 4, mid, NULL, 0);
  uint32_t t3 = value(g, xnn_datatype_fp32, 4, mid, NULL, 0), t4 = value(g, xnn_datatype_fp32, 2, flat, NULL, 0);
  uint32_t t5 = value(g, xnn_datatype_fp32, 2, h1, NULL, 0);
#define W(name, nd, dims) value(g, xnn_datatype_fp32, nd, dims, tensor(name, NULL), 0)
  check(xnn_define_convolution_2d(g->sg, 1, 1, 1, 1, 3, 3, 1, 1, 1, 1, 1, 32, 64, -inf, inf, g->in_id,
                                  W("net.conv.weight", 4, cw), W("net.conv.bias", 1, b64), t1, 0),
        "net: convolution");
  check(xnn_define_depthwise_convolution_2d(g->sg, 1, 1, 1, 1, 3, 3, 1, 1, 1, 1, 1, 64, -inf, inf, t1,
                                            W("net.dw.weight", 4, dw), W("net.dw.bias", 1, b64), t2, 0),
        "net: depthwise convolution");
  check(xnn_define_convolution_2d(g->sg, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 64, 64, -inf, inf, t2,
                                  W("net.pw.weight", 4, pw), W("net.pw.bias", 1, b64), t3, 0),
        "net: 1x1 convolution");
  check(xnn_define_static_reshape(g->sg, 2, flat, t3, t4, 0), "net: reshape");
  check(xnn_define_fully_connected(g->sg, -inf, inf, t4, W("net.fc1.weight", 2, f1), W("net.fc1.bias", 1, b1), t5, 0),
        "net: fully connected 1");
  check(xnn_define_fully_connected(g->sg, -inf, inf, t5, W("net.fc2.weight", 2, f2), W("net.fc2.bias", 1, b2),
                                   g->out_id, 0),
        "net: fully connected 2");
#undef W
}

static void other(struct graph* g, const char* op) {
  const float inf = INFINITY;
  if (!strcmp(op, "convnet-f32")) {
    convnet(g);
  } else if (!strncmp(op, "fc-", 3)) {
    int qs8 = !strcmp(op, "fc-qs8"), qc4 = !strcmp(op, "fc-qc4w"), qd8 = !strcmp(op, "fc-qd8") || qc4;
    size_t k = qc4 ? 68 : 67, in[2] = {3, k}, out[2] = {3, 45}, w[2] = {45, k}, b[1] = {45};
    io(g, 2, in, 2, out, qs8, 1, 0.04f, 5, 0.3f);
    uint32_t x = g->in_id, wid, bid;
    if (qc4) {
      wid = cvalue(g, xnn_datatype_qcint4, 8, scales("fc.q4scale"), 2, w, tensor("fc.q4weight", NULL));
    } else if (qs8 || qd8) {
      wid = cvalue(g, xnn_datatype_qcint8, 0, scales("fc.qscale"), 2, w, tensor("fc.qweight", NULL));
    } else {
      wid = value(g, xnn_datatype_fp32, 2, w, tensor("fc.weight", NULL), 0);
    }
    if (qd8) x = qd8_input(g, 2, in);
    bid = qs8 ? qs8_bias(g, "fc.qbias", scales("fc.qscale"), 45, 0.04f)
              : value(g, xnn_datatype_fp32, 1, b, tensor("fc.bias", NULL), 0);
    float lo = qs8 ? -127.f * 0.3f : -inf, hi = qs8 ? 127.f * 0.3f : inf;
    check(xnn_define_fully_connected(g->sg, lo, hi, x, wid, bid, g->out_id, 0), "fully connected");
    if (!strcmp(op, "fc-f16")) g->flags = XNN_FLAG_FORCE_FP16_INFERENCE;
  } else if (!strcmp(op, "bmm-f32")) {
    size_t in[3] = {2, 3, 10}, out[3] = {2, 3, 6}, w[3] = {2, 10, 6};
    io(g, 3, in, 3, out, 0, 0, 0, 0, 0);
    uint32_t wid = value(g, xnn_datatype_fp32, 3, w, tensor("bmm.weight", NULL), 0);
    check(xnn_define_batch_matrix_multiply(g->sg, g->in_id, wid, g->out_id, 0), "batch matrix multiply");
  } else if (!strcmp(op, "prelu-f32")) {
    size_t in[4] = {1, 5, 5, 16}, s[1] = {16};
    io(g, 4, in, 4, in, 0, 0, 0, 0, 0);
    uint32_t sid = value(g, xnn_datatype_fp32, 1, s, tensor("prelu.slope", NULL), 0);
    check(xnn_define_binary(g->sg, xnn_binary_prelu, NULL, g->in_id, sid, g->out_id, 0), "prelu");
  } else {
    conv(g, op);
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

/* Builds OP's subgraph, creates and runs its runtime with `provider` (NULL: no cache);
 * writes the output's BLAKE3 and the time to ready. */
static void run(const char* op, struct xnn_weights_cache_provider* provider, PackdXnnCache* cache,
                xnn_weights_cache_t own, const char* finalize_when, char digest[65], double* ready_ms) {
  double t0 = now_ms();
  struct graph g = {0};
  check(xnn_create_subgraph(0, 0, &g.sg), "xnn_create_subgraph");
  other(&g, op);
  xnn_runtime_t rt;
  check(xnn_create_runtime_v4(g.sg, provider, NULL, NULL, g.flags, &rt), "xnn_create_runtime");
  if (finalize_when) {
    for (int i = 0; i < 12000 && access(finalize_when, F_OK) != 0; i++) {
      struct timespec ts = {0, 5000000};
      nanosleep(&ts, NULL);
    }
  }
  if (cache && packd_xnn_cache_finalize(cache) != PACKD_STATUS_OK) die("finalize", packd_last_error());
  if (own) check(xnn_finalize_weights_cache(own, xnn_weights_cache_finalization_kind_soft), "finalize");
  check(xnn_reshape_runtime(rt), "xnn_reshape_runtime");
  uint8_t* in = malloc(g.in_len + XNN_EXTRA_BYTES);
  uint8_t* out = calloc(1, g.out_len + XNN_EXTRA_BYTES);
  if (!in || !out) die("out of memory", NULL);
  for (size_t i = 0; i < g.in_len; i++) in[i] = (uint8_t)(i * 2654435761u >> 13);
  if (!g.in_q) /* f32 inputs in [-1, 1) */
    for (size_t i = 0; i < g.in_len / 4; i++) ((float*)in)[i] = (float)((int)((i * 2654435761u) % 2001) - 1000) / 1000.0f;
  struct xnn_external_value ext[2] = {{g.in_id, in}, {g.out_id, out}};
  check(xnn_setup_runtime_v2(rt, 2, ext), "xnn_setup_runtime");
  *ready_ms = now_ms() - t0;
  check(xnn_invoke_runtime(rt), "xnn_invoke_runtime");
  packd_blake3_hex(out, g.out_len, digest);
  xnn_delete_runtime(rt);
  xnn_delete_subgraph(g.sg);
  free(in);
  free(out);
}

static PackdModel* map_model(PackdClient* client, const char* path) {
  PackdModel* m;
  if (packd_pack_path(client, path, "identity", NULL, 0, &m) != PACKD_STATUS_OK)
    die("cannot map the model from packd", packd_last_error());
  nentries = packd_model_entry_count(m);
  if (nentries > 256) die("too many tensors", path);
  for (size_t i = 0; i < nentries; i++) packd_model_entry(m, i, &entries[i]);
  return m;
}

/* A, B, A again in one process through one cache: B's weights at A's old addresses must never
 * hit A's packings, nor A's (mapped anew) B's. */
static int reuse(PackdClient* client, const char* a, const char* b, const char* op) {
  char ref[3][65], got[3][65];
  const char* paths[3] = {a, b, a};
  uintptr_t at[3];
  double ready;
  for (int i = 0; i < 3; i++) { /* references: no cache at all */
    model = map_model(client, paths[i]);
    run(op, NULL, NULL, NULL, NULL, ref[i], &ready);
    packd_model_release(model);
  }
  PackdXnnOptions o = {0};
  o.model = "reuse-test";
  o.engine_symbol = (const void*)&xnn_create_runtime_v4;
  o.extra = op;
  PackdXnnCache* cache;
  if (packd_xnn_cache_create(client, &o, &cache) != PACKD_STATUS_OK) die("cache", packd_last_error());
  struct xnn_weights_cache_provider provider;
  packd_xnn_fill_provider(cache, &provider);
  for (int i = 0; i < 3; i++) {
    model = map_model(client, paths[i]);
    at[i] = (uintptr_t)entries[0].data;
    run(op, &provider, NULL, NULL, NULL, got[i], &ready);
    packd_model_release(model);
  }
  packd_xnn_cache_finalize(cache);
  PackdXnnStats s;
  packd_xnn_cache_stats(cache, &s);
  printf("{\"op\":\"%s\",\"same_address\":%s,\"outputs_match\":%s,\"hits\":%llu,\"misses\":%llu,"
         "\"conflicts\":%llu}\n",
         op, at[1] == at[0] && at[2] == at[0] ? "true" : "false",
         !strcmp(ref[0], got[0]) && !strcmp(ref[1], got[1]) && !strcmp(ref[2], got[2]) && strcmp(ref[0], ref[1])
             ? "true"
             : "false",
         (unsigned long long)s.hits, (unsigned long long)s.misses, (unsigned long long)s.conflicts);
  packd_xnn_cache_free(cache);
  return 0;
}

int main(int argc, char** argv) {
  const char *dir = NULL, *path = NULL, *op = NULL, *finalize_when = NULL;
  int private_cache = 0, no_cache = 0;
  double hold = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--list")) {
      for (size_t j = 0; j < NOPS; j++) printf("%s\n", OPS[j]);
      return 0;
    } else if (!strcmp(argv[i], "--socket-dir") && i + 1 < argc) dir = argv[++i];
    else if (!strcmp(argv[i], "--model") && i + 1 < argc) path = argv[++i];
    else if (!strcmp(argv[i], "--op") && i + 1 < argc) op = argv[++i];
    else if (!strcmp(argv[i], "--finalize-when") && i + 1 < argc) finalize_when = argv[++i];
    else if (!strcmp(argv[i], "--hold") && i + 1 < argc) hold = atof(argv[++i]);
    else if (!strcmp(argv[i], "--private")) private_cache = 1;
    else if (!strcmp(argv[i], "--no-cache")) no_cache = 1;
    else if (!strcmp(argv[i], "--unnamed")) unnamed = 1;
    else if (!strcmp(argv[i], "--no-amx")) deny_amx();
    else if (!strcmp(argv[i], "--reuse") && i + 3 < argc) {
      PackdClient* client;
      if (packd_connect(dir, &client) != PACKD_STATUS_OK) die("cannot connect to packd", packd_last_error());
      check(xnn_initialize(NULL), "xnn_initialize");
      return reuse(client, argv[i + 1], argv[i + 2], argv[i + 3]);
    } else die("unknown argument (see the comment at the top of ops.c)", argv[i]);
  }
  if (!path || !op) die("--model FILE and --op OP are required", NULL);
  PackdClient* client;
  if (packd_connect(dir, &client) != PACKD_STATUS_OK) die("cannot connect to packd", packd_last_error());
  double t0 = now_ms();
  model = map_model(client, path);
  check(xnn_initialize(NULL), "xnn_initialize");

  PackdXnnCache* cache = NULL;
  struct xnn_weights_cache_provider provider, *own = NULL;
  struct counting counting = {0};
  if (!no_cache && !private_cache) {
    PackdXnnOptions o = {0};
    o.model = strchr(packd_model_key(model), ':') + 1; /* b3:<source>@plan:... */
    o.engine_symbol = (const void*)&xnn_create_runtime_v4;
    static char extra[128];
    snprintf(extra, sizeof extra, "op=%s%s", op, unnamed ? ";unnamed" : "");
    o.extra = extra;
    if (packd_xnn_cache_create(client, &o, &cache) != PACKD_STATUS_OK) die("cache", packd_last_error());
    packd_xnn_fill_provider(cache, &provider);
  } else if (private_cache) {
    check(xnn_create_weights_cache_with_size(1 << 20, &own), "xnn_create_weights_cache");
    counting.inner = own;
    memcpy(&provider, own, sizeof provider); /* every callback of this interface, then ours */
    provider.context = &counting;
    provider.look_up = c_look_up;
    provider.reserve_space = c_reserve;
    provider.look_up_or_insert = c_insert;
    provider.is_finalized = c_finalized;
    provider.offset_to_addr = c_addr;
  }
  char digest[65];
  double ready;
  run(op, no_cache ? NULL : &provider, cache, own, finalize_when, digest, &ready);
  ready += 0 * t0;
  PackdXnnStats s = {0};
  if (cache) {
    packd_xnn_cache_wait(cache);
    packd_xnn_cache_stats(cache, &s);
  }
  static const char* modes[] = {"served", "building", "published", "private"};
  /* The interface as packd tells it at run time from the library's symbols. */
  uint32_t engine_interface = 0;
  if (packd_xnn_engine_interface((const void*)&xnn_create_runtime_v4, &engine_interface) != PACKD_STATUS_OK)
    fprintf(stderr, "ops: %s\n", packd_last_error());
  long long reserve = cache ? (long long)s.reserve_space : (private_cache ? (long long)counting.reserve_calls : -1);
  long long packed = cache ? (long long)s.bytes_packed : (private_cache ? (long long)counting.bytes : -1);
  printf("{\"op\":\"%s\",\"cache\":\"%s\",\"hits\":%llu,\"misses\":%llu,\"reserve_space\":%lld,"
         "\"bytes_packed\":%lld,\"bytes_private\":%llu,\"bytes_shared\":%llu,\"unnamed\":%llu,"
         "\"deduplicated\":%llu,\"ready_ms\":%.3f,\"output_blake3\":\"%s\",\"interface\":%d,\"engine_interface\":%u,"
         "\"reason\":\"%s\"}\n",
         op, cache ? modes[s.mode & 3] : (private_cache ? "xnnpack" : "none"), (unsigned long long)s.hits,
         (unsigned long long)s.misses, reserve, packed, (unsigned long long)s.bytes_private,
         (unsigned long long)s.bytes_shared, (unsigned long long)s.unnamed, (unsigned long long)s.deduplicated, ready,
         digest, (int)PACKD_XNN_INTERFACE, engine_interface, cache ? packd_xnn_cache_reason(cache) : "");
  fflush(stdout);
  if (hold > 0) {
    struct timespec ts = {(time_t)hold, (long)((hold - (time_t)hold) * 1e9)};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
  }
  if (own) xnn_delete_weights_cache(own);
  packd_xnn_cache_free(cache);
  packd_model_release(model);
  packd_client_free(client);
  return 0;
}
