//! `packctl bench …`: measurements that compare packd with a baseline in the same run.

mod attach;
mod first_pack;
mod hist;
mod memory;
mod pack;
mod plot;
mod restart;
mod scale;
mod stress;

use std::path::Path;
use std::process::ExitCode;

use clap::Subcommand;

/// What to measure.
#[derive(Debug, Subcommand)]
pub enum Bench {
    /// Packing throughput of each layout on each ISA this CPU has, single-threaded, against
    /// memcpy of the same size in the same run; warm (pre-faulted destination) and cold
    /// (a fresh memfd, page faults included). Runs in-process; no daemon needed.
    Pack(pack::PackArgs),
    /// Attach latency (get + map + release of a packed model) from N client processes,
    /// against the floor: a bare fd-passing server answering with a pre-created memfd.
    Attach(attach::AttachArgs),
    /// Memory of N processes holding one model through packd, against N processes that each
    /// pack it privately; time to ready of the first and the rest.
    Memory(memory::MemoryArgs),
    /// Attach latency for one entry as the index grows, and the daemon's memory per entry.
    Scale(scale::ScaleArgs),
    /// Serving again after a restart (fd store) and after a reboot (cache directory),
    /// against repacking the same models; READY latency of an empty daemon; the cost of
    /// serving cache files copied into sealed memfds against mapping them in place. Starts
    /// its own packd (it plays the service manager); no running daemon needed.
    Restart(restart::RestartArgs),
    /// The first pack of a model through a fresh daemon (the whole client call, with the
    /// daemon's stage times) against packing it in process with packd's packer, the floor
    /// measured in the same run (one read of the file + fresh shared memory filled on every
    /// core) and, with $XNNPACK_ROOT, XNNPACK packing the model's FC layers in process.
    FirstPack(first_pack::FirstPackArgs),
    /// Random pack/get/map/verify/release from N client processes that are SIGKILLed at
    /// random points and replaced, under forced evictions; reports operations, errors by
    /// kind, checksum failures and leaked leases and fds (all of the last three must be 0;
    /// exit status 1 otherwise). Needs a running daemon and an admin (for Evict).
    Stress(stress::StressArgs),
    /// (internal) one client process of `bench attach`.
    #[command(hide = true)]
    AttachWorker(attach::AttachWorkerArgs),
    /// (internal) one holder process of `bench memory`.
    #[command(hide = true)]
    MemoryWorker(memory::MemoryWorkerArgs),
    /// (internal) one client process of `bench stress`.
    #[command(hide = true)]
    StressWorker(stress::StressWorkerArgs),
}

pub use packd_testkit::safetensors::head as safetensors_head;

/// Runs `packctl bench …` against the daemon in `dir` (where one is needed).
pub fn run(dir: &Path, bench: Bench) -> anyhow::Result<ExitCode> {
    match bench {
        Bench::Pack(a) => pack::pack(a),
        Bench::Attach(a) => attach::run(dir, a),
        Bench::Memory(a) => memory::run(dir, a),
        Bench::Scale(a) => scale::run(dir, a),
        Bench::Restart(a) => restart::run(a),
        Bench::FirstPack(a) => first_pack::run(a),
        Bench::AttachWorker(a) => attach::worker(dir, a),
        Bench::MemoryWorker(a) => memory::worker(dir, a),
        Bench::Stress(a) => stress::run(dir, a),
        Bench::StressWorker(a) => stress::worker(dir, a),
    }
}
