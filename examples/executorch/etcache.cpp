// ExecuTorch's own packed-weights file cache (PRs 19862/19988, in 1.5), the anchor packd is
// measured against: loads a method with the XNNPACK backend's weights cache on and, when a
// path is given, its `packed_cache_path` (a file one process writes and later ones map).
// Reachable only from C++ (Module::load_method with a LoadBackendOptionsMap).
//
//   etcache MODEL.pte CACHE_PATH|- [START_AT_EPOCH [HOLD_SECONDS]]
//
// Prints {"load_ms": ..., "ok": 1, "pid": ...}. Built by examples/executorch/bench.py
// against the wheel's headers and libraries.
#include <executorch/extension/module/module.h>
#include <executorch/runtime/backend/backend_options_map.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/platform/runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <unistd.h>

using executorch::extension::module::Module;
using executorch::runtime::BackendOptions;
using executorch::runtime::Error;
using executorch::runtime::LoadBackendOptionsMap;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: etcache MODEL.pte CACHE_PATH|- [START_AT_EPOCH [HOLD_SECONDS]]\n");
    return 2;
  }
  executorch::runtime::runtime_init();
  BackendOptions<1> global;
  global.set_option("weight_cache_enabled", true);
  if (executorch::runtime::set_option("XnnpackBackend", global.view()) != Error::Ok) {
    std::fprintf(stderr, "etcache: cannot turn XNNPACK's weights cache on\n");
    return 1;
  }
  Module module(argv[1], Module::LoadMode::Mmap);
  LoadBackendOptionsMap map;
  BackendOptions<1> per_load;
  const bool cache = std::strcmp(argv[2], "-") != 0;
  if (cache) {
    per_load.set_option("packed_cache_path", argv[2]);
    map.set_options("XnnpackBackend", per_load.view());
  }
  if (argc > 3) {
    const double start = std::atof(argv[3]);
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    if (start > now) std::this_thread::sleep_for(std::chrono::duration<double>(start - now));
  }
  const auto t0 = std::chrono::steady_clock::now();
  const Error err = module.load_method("forward", nullptr, nullptr, cache ? &map : nullptr);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("{\"load_ms\": %.3f, \"ok\": %d, \"pid\": %d}\n", ms, err == Error::Ok ? 1 : 0, (int)getpid());
  std::fflush(stdout);
  if (argc > 4) std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(argv[4])));
  return err == Error::Ok ? 0 : 1;
}
