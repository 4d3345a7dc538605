/* A llama.cpp worker for packd's tests and benchmarks: loads a GGUF, decodes a fixed
 * prompt of token ids, generates greedily, prints one line of JSON — load time, prompt and
 * generation tokens per second, and a digest of every logit it computed (bit-identity is
 * compared on it) — then, with --hold, prints "ready" and keeps the model loaded until its
 * stdin closes (to measure memory while N workers hold the model).
 *
 *   holder MODEL.gguf [--no-repack] [--no-mmap] [--prompt N] [--gen N] [--threads N] [--hold] [--lib LIBLLAMA]
 *          [--load-only]
 *
 * --load-only loads the model and prints {"load_ms":…,"loaded":true,"repack":…} without
 * decoding (a build whose kernels crash, such as ggml's AMX on some CPUs, still loads).
 * With ggml's backends as modules (GGML_BACKEND_DL, llama.cpp's release layout),
 * llama_backend_init loads the best CPU module from beside the program or from the
 * current directory: run it from the libraries' directory.
 *
 * Build against llama.cpp's shared libraries (examples/llama/fetch-llama prints ROOT):
 *   cc -O2 holder.c -IROOT/include -LROOT/lib -lllama -lggml -lggml-base -Wl,--disable-new-dtags,-rpath,ROOT/lib -o holder
 * or, to load llama.cpp at run time as Python's ctypes does (dlopen, RTLD_LOCAL), from
 * --lib PATH (libllama.so):
 *   cc -O2 -DHOLDER_DLOPEN holder.c -IROOT/include -ldl -o holder-dlopen
 * Add -DHOLDER_USE_MMAP_BOOL for a llama.cpp whose llama.h has no `enum llama_load_mode`
 * (llama-cpp-python 0.3.19, 0.3.30: `use_mmap` instead).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llama.h"

#ifdef HOLDER_DLOPEN
#include <dlfcn.h>
/* Every llama.cpp function used below, resolved from the library at run time. */
#define LLAMA_FUNCS(X) X(llama_log_set) X(llama_backend_init) X(llama_model_default_params) \
    X(llama_model_load_from_file) X(llama_context_default_params) X(llama_init_from_model) \
    X(llama_model_get_vocab) X(llama_vocab_n_tokens) X(llama_batch_get_one) X(llama_decode) \
    X(llama_get_logits_ith) X(llama_free) X(llama_model_free) X(llama_backend_free)
#define DECLARE(f) static __typeof__(f) *dl_##f;
LLAMA_FUNCS(DECLARE)
#define RESOLVE(f) if (!(dl_##f = (__typeof__(f) *)dlsym(lib, #f))) { fprintf(stderr, "holder: %s: no %s\n", path, #f); return 1; }
static int load_llama(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "holder: %s\n", dlerror()); return 1; }
    LLAMA_FUNCS(RESOLVE)
    return 0;
}
#define llama_log_set dl_llama_log_set
#define llama_backend_init dl_llama_backend_init
#define llama_model_default_params dl_llama_model_default_params
#define llama_model_load_from_file dl_llama_model_load_from_file
#define llama_context_default_params dl_llama_context_default_params
#define llama_init_from_model dl_llama_init_from_model
#define llama_model_get_vocab dl_llama_model_get_vocab
#define llama_vocab_n_tokens dl_llama_vocab_n_tokens
#define llama_batch_get_one dl_llama_batch_get_one
#define llama_decode dl_llama_decode
#define llama_get_logits_ith dl_llama_get_logits_ith
#define llama_free dl_llama_free
#define llama_model_free dl_llama_model_free
#define llama_backend_free dl_llama_backend_free
#endif

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

/* FNV-1a 64 over bytes. */
static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Says "ready", then keeps the model loaded until stdin closes. */
static void hold_until_stdin_closes(void) {
    puts("ready");
    fflush(stdout);
    char buf[256];
    while (fread(buf, 1, sizeof buf, stdin) > 0) {}
}

static int usage(const char *why) {
    fprintf(stderr, "holder: %s\nusage: holder MODEL.gguf [--no-repack] [--no-mmap] [--prompt N] [--gen N] [--threads N] [--hold] [--lib LIBLLAMA] [--load-only]\n", why);
    return 2;
}

int main(int argc, char **argv) {
    const char *path = NULL, *lib = NULL;
    int repack = 1, hold = 0, mapped = 1, load_only = 0, n_prompt = 32, n_gen = 16, threads = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--no-repack")) repack = 0;
        else if (!strcmp(a, "--no-mmap")) mapped = 0;
        else if (!strcmp(a, "--hold")) hold = 1;
        else if (!strcmp(a, "--load-only")) load_only = 1;
        else if (!strcmp(a, "--prompt") && i + 1 < argc) n_prompt = atoi(argv[++i]);
        else if (!strcmp(a, "--gen") && i + 1 < argc) n_gen = atoi(argv[++i]);
        else if (!strcmp(a, "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(a, "--lib") && i + 1 < argc) lib = argv[++i];
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage("help"); return 0; }
        else if (a[0] == '-') return usage("unknown option");
        else if (!path) path = a;
        else return usage("one model only");
    }
    if (!path) return usage("no model given");
    if (n_prompt < 1 || n_gen < 0 || threads < 1) return usage("bad number");
#ifdef HOLDER_DLOPEN
    if (!lib) return usage("--lib PATH (libllama.so) is needed by this build");
    if (load_llama(lib)) return 1;
#else
    if (lib) return usage("--lib needs a build with -DHOLDER_DLOPEN");
#endif

    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = repack;
#ifdef HOLDER_USE_MMAP_BOOL
    if (!mapped) mp.use_mmap = false; // llama.cpp before load_mode (llama-cpp-python < 0.3.36)
#else
    if (!mapped) mp.load_mode = LLAMA_LOAD_MODE_NONE; // read into memory, as use_mmap=False does
#endif
    double t0 = now_ms();
    struct llama_model *model = llama_model_load_from_file(path, mp);
    double load_ms = now_ms() - t0;
    if (!model) { fprintf(stderr, "holder: cannot load %s\n", path); return 1; }
    if (load_only) {
        printf("{\"load_ms\":%.3f,\"loaded\":true,\"repack\":%s}\n", load_ms, repack ? "true" : "false");
        fflush(stdout);
        if (hold) hold_until_stdin_closes();
        llama_model_free(model);
        llama_backend_free();
        return 0;
    }

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_prompt + n_gen + 8;
    cp.n_batch = n_prompt;
    cp.n_ubatch = n_prompt;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "holder: cannot create a context\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    llama_token *tokens = malloc(sizeof(llama_token) * (size_t)n_prompt);
    for (int i = 0; i < n_prompt; i++) tokens[i] = 3 + (i * 37) % (n_vocab - 3);
    uint64_t digest = 1469598103934665603ull;
    double t1 = now_ms();
    if (llama_decode(ctx, llama_batch_get_one(tokens, n_prompt))) { fprintf(stderr, "holder: decode failed\n"); return 1; }
    const float *logits = llama_get_logits_ith(ctx, -1);
    double prompt_ms = now_ms() - t1;
    double first_ms = now_ms() - t0; // load, context and first prompt: a first answer's wait
    digest = fnv(digest, logits, sizeof(float) * (size_t)n_vocab);
    double t2 = now_ms();
    for (int g = 0; g < n_gen; g++) {
        llama_token best = 0;
        for (int v = 1; v < n_vocab; v++) if (logits[v] > logits[best]) best = v;
        if (llama_decode(ctx, llama_batch_get_one(&best, 1))) { fprintf(stderr, "holder: decode failed\n"); return 1; }
        logits = llama_get_logits_ith(ctx, -1);
        digest = fnv(digest, logits, sizeof(float) * (size_t)n_vocab);
    }
    double gen_ms = now_ms() - t2;
    printf("{\"load_ms\":%.3f,\"first_ms\":%.3f,\"prompt_tps\":%.2f,\"gen_tps\":%.2f,\"logits\":\"%016llx\",\"repack\":%s}\n",
           load_ms, first_ms, n_prompt / (prompt_ms / 1e3), n_gen > 0 ? n_gen / (gen_ms / 1e3) : 0.0,
           (unsigned long long)digest, repack ? "true" : "false");
    fflush(stdout);
    if (hold) hold_until_stdin_closes();
    free(tokens);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
