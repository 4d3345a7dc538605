/* An ONNX Runtime worker in C: creates a session on the CPU (through packd with --packd),
 * runs one inference on a fixed input and prints one JSON line.
 *
 *     worker MODEL.onnx [--packd] [--hold]
 *
 * Every input must be float (dimensions left open are 2). The line has `output_fnv` (a hash
 * of the first output's bytes), `pid`, `memfd` (the packd memory mapped, or ""), and with
 * --packd `packd` (packd_onnxruntime_status()). --hold waits for standard input to close.
 *
 * Build (examples/onnxruntime/fetch-ort-headers gives the headers; the onnxruntime wheel
 * has the library):
 *     cc worker.c -I$HEADERS -I../../onnxruntime/c/include -L$ORT_LIB -l:libonnxruntime.so.1.32.0 \
 *        -L$TARGET -lpackd_onnxruntime -Wl,-rpath,$ORT_LIB:$TARGET -o worker
 */
#include <math.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <onnxruntime_c_api.h>
#include <packd_onnxruntime.h>

static const OrtApi *ort;

static void check(OrtStatus *st, const char *what) {
  if (st != NULL) {
    printf("{\"error\": \"%s: %s\"}\n", what, ort->GetErrorMessage(st));
    exit(1);
  }
}

static void packd_memfd(char *out, size_t len) {
  out[0] = 0;
  FILE *f = fopen("/proc/self/maps", "r");
  char line[4096];
  while (f != NULL && fgets(line, sizeof line, f) != NULL) {
    char dev[64], path[2048];
    unsigned long inode;
    if (sscanf(line, "%*s %*s %*s %63s %lu %2047s", dev, &inode, path) == 3 && strncmp(path, "/memfd:packd", 12) == 0) {
      snprintf(out, len, "%s:%lu", dev, inode);
      break;
    }
  }
  if (f != NULL) fclose(f);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: worker MODEL.onnx [--packd] [--hold]\n");
    return 2;
  }
  int packd = 0, hold = 0;
  for (int i = 2; i < argc; i++) {
    packd |= strcmp(argv[i], "--packd") == 0;
    hold |= strcmp(argv[i], "--hold") == 0;
  }
  ort = OrtGetApiBase()->GetApi(ORT_API_VERSION);
  OrtEnv *env;
  check(ort->CreateEnv(ORT_LOGGING_LEVEL_WARNING, "worker", &env), "CreateEnv");
  OrtSessionOptions *options;
  check(ort->CreateSessionOptions(&options), "CreateSessionOptions");
  check(ort->SetIntraOpNumThreads(options, 1), "SetIntraOpNumThreads");
  OrtSession *session;
  packd_ort_share *share = NULL;
  if (packd) {
    check(packd_ort_create_session(ort, env, argv[1], options, ORT_ENABLE_ALL, &session, &share), "CreateSession");
  } else {
    check(ort->CreateSession(env, argv[1], options, &session), "CreateSession");
  }

  OrtAllocator *alloc;
  check(ort->GetAllocatorWithDefaultOptions(&alloc), "GetAllocator");
  size_t n_in;
  check(ort->SessionGetInputCount(session, &n_in), "SessionGetInputCount");
  OrtMemoryInfo *mem;
  check(ort->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &mem), "CreateCpuMemoryInfo");
  char **in_names = calloc(n_in, sizeof *in_names);
  OrtValue **inputs = calloc(n_in, sizeof *inputs);
  for (size_t i = 0; i < n_in; i++) {
    check(ort->SessionGetInputName(session, i, alloc, &in_names[i]), "SessionGetInputName");
    OrtTypeInfo *type;
    check(ort->SessionGetInputTypeInfo(session, i, &type), "SessionGetInputTypeInfo");
    const OrtTensorTypeAndShapeInfo *info;
    check(ort->CastTypeInfoToTensorInfo(type, &info), "CastTypeInfoToTensorInfo");
    size_t rank;
    check(ort->GetDimensionsCount(info, &rank), "GetDimensionsCount");
    int64_t dims[16] = {0};
    check(ort->GetDimensions(info, dims, rank), "GetDimensions");
    size_t count = 1;
    for (size_t d = 0; d < rank; d++) {
      if (dims[d] <= 0) dims[d] = 2;
      count *= (size_t)dims[d];
    }
    float *data = malloc(count * sizeof *data);
    for (size_t k = 0; k < count; k++) data[k] = (float)sin((double)k * 0.37);
    check(ort->CreateTensorWithDataAsOrtValue(mem, data, count * sizeof *data, dims, rank,
                                              ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, &inputs[i]),
          "CreateTensor");
    ort->ReleaseTypeInfo(type);
  }
  char *out_name;
  check(ort->SessionGetOutputName(session, 0, alloc, &out_name), "SessionGetOutputName");
  OrtValue *output = NULL;
  check(ort->Run(session, NULL, (const char *const *)in_names, (const OrtValue *const *)inputs, n_in,
                 (const char *const *)&out_name, 1, &output),
        "Run");
  OrtTensorTypeAndShapeInfo *out_info;
  check(ort->GetTensorTypeAndShape(output, &out_info), "GetTensorTypeAndShape");
  size_t elems;
  check(ort->GetTensorShapeElementCount(out_info, &elems), "GetTensorShapeElementCount");
  float *y;
  check(ort->GetTensorMutableData(output, (void **)&y), "GetTensorMutableData");
  uint64_t h = 1469598103934665603ull;
  const unsigned char *bytes = (const unsigned char *)y;
  for (size_t k = 0; k < elems * sizeof(float); k++) h = (h ^ bytes[k]) * 1099511628211ull;

  char memfd[128];
  packd_memfd(memfd, sizeof memfd);
  printf("{\"pid\": %d, \"output_fnv\": \"%016llx\", \"memfd\": \"%s\"", (int)getpid(), (unsigned long long)h, memfd);
  if (packd) {
    char status[16384];
    packd_onnxruntime_status(status, sizeof status);
    printf(", \"packd\": %s", status);
  }
  printf("}\n");
  fflush(stdout);
  if (hold) {
    while (getchar() != EOF) {
    }
  }
  ort->ReleaseValue(output);
  ort->ReleaseSession(session);
  packd_ort_free(share);
  ort->ReleaseSessionOptions(options);
  ort->ReleaseEnv(env);
  return 0;
}
