//! `packctl bench restart`: how fast packd serves again after a restart through the fd
//! store and after a reboot through the cache directory, against repacking the same models
//! in the same run; how long an empty daemon takes to READY=1; and what serving a cache file
//! would cost copied into a sealed memfd (packd's choice) against mapped in place.
//!
//! packctl plays the service manager itself ([`packd_testkit::supervisor`]): it keeps the listening
//! sockets and the fd store across daemon starts, as systemd does.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use packd_client::{Client, Plan};
use packd_testkit::supervisor::{self, Manager};
use serde_json::{Value, json};

/// Options of `bench restart`.
#[derive(Debug, Args)]
pub struct RestartArgs {
    /// Models to pack. Without any, synthetic f32 models of 128 MiB each are written, --gib
    /// of them in all.
    #[arg(long = "model", value_name = "FILE")]
    models: Vec<PathBuf>,
    /// GiB of synthetic models (without --model).
    #[arg(long, value_name = "GIB", default_value_t = 1.0)]
    gib: f64,
    /// Layout of the plan.
    #[arg(long, value_name = "SPEC", default_value = "", hide_default_value = true)]
    layout: String,
    /// The packd binary. Default: `packd` beside this packctl.
    #[arg(long, value_name = "FILE")]
    packd: Option<PathBuf>,
    /// Scratch directory (models, cache, sockets); on a disk, not tmpfs, for the reboot
    /// figure to mean anything. Default: a new directory under /var/tmp, removed afterwards.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Empty starts to time for READY latency.
    #[arg(long, value_name = "N", default_value_t = 5)]
    starts: usize,
    /// Leave the page cache alone (the reboot figure then reads warm files).
    #[arg(long)]
    keep_page_cache: bool,
    /// Reboots to time, each after a cold read of the same cache files (the floor, dropped
    /// page cache before each); medians are reported.
    #[arg(long, value_name = "N", default_value_t = 3)]
    runs: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// A daemon started by the bench.
struct Run {
    child: Child,
    spawned: Instant,
    ready: Duration,
}

impl Run {
    /// SIGTERM, and the time until the process exited.
    fn stop(mut self) -> anyhow::Result<Duration> {
        let t = Instant::now();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), nix::sys::signal::Signal::SIGTERM)?;
        let status = self.child.wait()?;
        let took = t.elapsed();
        if !status.success() {
            bail!("packd exited with {status}");
        }
        Ok(took)
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Bench {
    packd: PathBuf,
    dir: PathBuf,
    manager: Manager,
    sockets: Vec<(String, OwnedFd)>,
    /// SIGTERM-to-exit of each daemon stopped after serving every segment again (ms).
    stops: std::sync::Mutex<Vec<f64>>,
}

impl Bench {
    /// Starts packd with the kept sockets and the stored fds; returns once READY=1 arrived.
    fn start(&self, cache: bool) -> anyhow::Result<Run> {
        let before = self.manager.messages().len();
        let mut fds: Vec<(String, OwnedFd)> =
            self.sockets.iter().map(|(n, fd)| Ok((n.clone(), fd.try_clone()?))).collect::<std::io::Result<_>>()?;
        fds.extend(self.manager.stored()?);
        let cache_dir = self.dir.join("cache");
        let mut args = vec!["--socket-dir", self.dir.to_str().context("utf-8 dir")?, "--fd-store", "on"];
        args.extend(["--cache-dir", if cache { cache_dir.to_str().context("utf-8 dir")? } else { "off" }]);
        let mut cmd = self.manager.command(&self.packd, fds, &[("RUST_LOG", "info")], &args)?;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("packd.log"))?;
        cmd.env_remove("CACHE_DIRECTORY").env_remove("STATE_DIRECTORY").stdout(Stdio::null()).stderr(log);
        let spawned = Instant::now();
        let child = cmd.spawn().context("starting packd")?;
        let mut run = Run { child, spawned, ready: Duration::ZERO };
        if self.manager.wait_line_for(before, "READY=1", Duration::from_secs(600)).is_none() {
            bail!("packd sent no READY=1; see {}", self.dir.join("packd.log").display());
        }
        run.ready = spawned.elapsed();
        Ok(run)
    }

    fn pack_jobs(&self) -> anyhow::Result<u64> {
        Ok(self.stats()?.pack_jobs)
    }

    fn stats(&self) -> anyhow::Result<packd_client::proto::Stats> {
        super::super::control::stats(&self.dir)
    }

    /// Starts packd with its cache directory and whatever the fd store holds, gets every key;
    /// returns the time to READY=1, the time until every segment was served, the pack jobs.
    fn serve_again(&self, keys: &[String]) -> anyhow::Result<(Duration, Duration, u64)> {
        let r = self.start(true)?;
        serve_all(&self.dir, keys)?;
        let serving = r.spawned.elapsed();
        let jobs = self.pack_jobs()?;
        let ready = r.ready;
        self.stops.lock().map_err(|_| anyhow::anyhow!("stop times"))?.push(r.stop()?.as_secs_f64() * 1e3);
        Ok((ready, serving, jobs))
    }
}

/// Writes a 128 MiB f32 safetensors model whose values depend on `seed`.
fn synthetic_model(path: &Path, seed: u64) -> anyhow::Result<()> {
    const N: u64 = 4096;
    const K: usize = 8192;
    let head = super::safetensors_head([("layer.weight", "F32", [N, K as u64], [0, N * K as u64 * 4])]);
    let mut f = std::io::BufWriter::with_capacity(8 << 20, File::create(path)?);
    f.write_all(&head)?;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut row = vec![0u8; K * 4];
    for _ in 0..N {
        for v in row.chunks_exact_mut(4) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let val = ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
            v.copy_from_slice(&val.to_le_bytes());
        }
        f.write_all(&row)?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    Ok(())
}

/// Drops the page cache (root only); else asks the kernel to drop `files`' pages.
fn drop_page_cache(files: &[PathBuf], keep: bool) -> &'static str {
    if keep {
        return "kept (--keep-page-cache)";
    }
    if std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok() {
        return "dropped (drop_caches)";
    }
    for f in files {
        if let Ok(file) = File::open(f) {
            let _ = nix::fcntl::posix_fadvise(&file, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED);
        }
    }
    "advised away (POSIX_FADV_DONTNEED; not root)"
}

/// Threads packd reads its cache directory on (two per core).
fn read_threads() -> usize {
    2 * std::thread::available_parallelism().map_or(1, usize::from)
}

/// Reads every file once through the page cache on [`read_threads`] threads, as packd
/// reads its cache directory: the floor of a reboot.
fn cold_read(files: &[PathBuf]) -> anyhow::Result<Duration> {
    let queue = std::sync::Mutex::new(files.to_vec());
    let t = Instant::now();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..read_threads())
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    let mut buf = vec![0u8; 1 << 20];
                    loop {
                        let Some(path) = queue.lock().unwrap_or_else(|p| p.into_inner()).pop() else { return Ok(()) };
                        let mut f = File::open(&path)?;
                        while std::io::Read::read(&mut f, &mut buf)? > 0 {}
                    }
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })?;
    Ok(t.elapsed())
}

fn files_in(dir: &Path, ext: &str) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == ext)).collect())
        .unwrap_or_default()
}

/// Gets and maps every key; returns when all are mapped.
fn serve_all(dir: &Path, keys: &[String]) -> anyhow::Result<()> {
    let client = Client::connect(dir)?;
    for k in keys {
        client.get(k).with_context(|| format!("get {k}"))?;
    }
    Ok(())
}

/// `Shmem` and `Cached` of /proc/meminfo, in bytes.
fn meminfo() -> (i64, i64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| -> i64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<i64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("Shmem:"), field("Cached:"))
}

/// The two ways of serving a cache file again, each on one thread after dropping the page
/// cache: copy into a sealed memfd with verification (packd), or check the file in place
/// (its fd would be served). Returns seconds of each, the bytes, and the memory each holds
/// afterwards: (shared memory, page cache) for the copy, page cache for in place.
fn serving_strategies(cache: &Path, page: u64, keep: bool) -> anyhow::Result<Value> {
    // As packd with its default `huge_pages` adopts on this host.
    let huge = packd::sys::proc::huge_pages_only_when_advised();
    let files = files_in(cache, packd::persist::cache::EXT);
    drop_page_cache(&files, keep);
    let (shmem0, cached0) = meminfo();
    let t = Instant::now();
    let mut held = Vec::new();
    for f in &files {
        held.push(packd::persist::cache::read(f, page, 1, huge, |_| true)?);
    }
    let copy_s = t.elapsed().as_secs_f64();
    let (shmem1, cached1) = meminfo();
    let bytes: u64 = held.iter().map(|a| a.size).sum();
    drop(held);
    drop_page_cache(&files, keep);
    let (_, cached2) = meminfo();
    let t = Instant::now();
    let mut held = Vec::new();
    for f in &files {
        held.push(packd_testkit::check_in_place(f, page)?);
    }
    let in_place_s = t.elapsed().as_secs_f64();
    let (_, cached3) = meminfo();
    Ok(json!({
        "bytes": bytes,
        "copy_into_sealed_memfd_s": copy_s,
        "map_file_in_place_s": in_place_s,
        "copy_shmem_bytes": shmem1 - shmem0,
        "copy_page_cache_bytes": (cached1 - cached0) - (shmem1 - shmem0),
        "in_place_page_cache_bytes": cached3 - cached2,
    }))
}

/// What a reboot's adoption costs in CPU time, one thread, the files in the page cache
/// (seconds per GiB of files): reading them (the cold read's own work), reading and
/// hashing with BLAKE3, reading and copying into a memfd, and packd's whole adoption
/// (all three, and sealing). With `cores` cores a reboot cannot take less than
/// `adopt / cores` per GiB (`cpu_floor_s_per_gib`), whatever the disk does.
fn adoption_cpu(cache: &Path, page: u64) -> anyhow::Result<Value> {
    let huge = packd::sys::proc::huge_pages_only_when_advised();
    /// What a pass does with each chunk: the file, the chunk's bytes and its offset.
    type ChunkFn<'a> = dyn FnMut(&File, &[u8], u64) -> std::io::Result<()> + 'a;
    const CHUNK: usize = 256 << 10;
    let files = files_in(cache, packd::persist::cache::EXT);
    let mut total = 0u64;
    for f in &files {
        total += std::fs::read(f)?.len() as u64;
    }
    let gib = (total as f64 / f64::from(1u32 << 30)).max(1e-9);
    let mut buf = vec![0u8; CHUNK];
    // Every file in CHUNK-sized reads, each chunk handed to `each`.
    let mut pass = |each: &mut ChunkFn<'_>| -> anyhow::Result<f64> {
        let t = Instant::now();
        for f in &files {
            let file = File::open(f)?;
            let len = file.metadata()?.len();
            let mut at = 0;
            while at < len {
                let n = usize::try_from((len - at).min(CHUNK as u64))?;
                std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf[..n], at)?;
                each(&file, &buf[..n], at)?;
                at += n as u64;
            }
        }
        Ok(t.elapsed().as_secs_f64() / gib)
    };
    let read = pass(&mut |_, chunk, _| {
        std::hint::black_box(chunk);
        Ok(())
    })?;
    let mut hasher = blake3::Hasher::new();
    let hash = pass(&mut |_, chunk, _| {
        hasher.update(chunk);
        Ok(())
    })?;
    std::hint::black_box(hasher.finalize());
    let memfd = packd::sys::memfd::create("packd-bench-copy")?;
    let copy = pass(&mut |file, chunk, at| {
        if at == 0 {
            memfd.set_len(0)?;
            memfd.set_len(file.metadata()?.len())?;
        }
        std::os::unix::fs::FileExt::write_all_at(&memfd, chunk, at)
    })?;
    drop(memfd);
    let mut adopt = 0.0;
    for f in &files {
        // Adoption drops the file's page cache behind it: read it back in first.
        std::fs::read(f)?;
        let t0 = Instant::now();
        let a = packd::persist::cache::read(f, page, 1, huge, |_| true)?;
        adopt += t0.elapsed().as_secs_f64();
        drop(a);
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    Ok(json!({"read_s_per_gib": read, "read_blake3_s_per_gib": hash, "read_copy_memfd_s_per_gib": copy,
              "adopt_s_per_gib": adopt / gib, "cores": cores, "cpu_floor_s_per_gib": adopt / gib / cores as f64}))
}

use super::hist::median;

/// Runs the benchmark.
pub fn run(args: RestartArgs) -> anyhow::Result<ExitCode> {
    let packd = match args.packd.clone() {
        Some(p) => p,
        None => std::env::current_exe()?.with_file_name("packd"),
    };
    // Scratch on disk, not in memory: the cache files are read back as after a reboot.
    let (dir, _cleanup) = match &args.dir {
        Some(d) => (d.clone(), None),
        None => {
            let t = packd_testkit::scratch_dir("packd-bench-restart-", true)?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    std::fs::create_dir_all(&dir)?;
    let manager = Manager::new(&dir)?;
    let sockets = supervisor::sockets(&dir)?;
    let b = Bench { packd, dir: dir.clone(), manager, sockets, stops: std::sync::Mutex::new(Vec::new()) };
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)?
        .and_then(|p| u64::try_from(p).ok())
        .context("the page size")?;

    // READY latency with nothing to adopt.
    let (mut ready_empty, mut stop_empty) = (Vec::new(), Vec::new());
    for _ in 0..args.starts.max(1) {
        let r = b.start(false)?;
        ready_empty.push(r.ready.as_secs_f64() * 1e3);
        // Idle once ready: the stop is SIGTERM to exit with nothing to finish.
        stop_empty.push(r.stop()?.as_secs_f64() * 1e3);
        b.manager.clear_store();
    }

    let models = if args.models.is_empty() {
        anyhow::ensure!(args.gib > 0.0 && args.gib <= 64.0, "--gib must be in (0, 64]");
        // 8 models of 128 MiB per GiB; the bound above keeps this exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let n = ((args.gib * 8.0).ceil() as u64).max(1);
        eprintln!("writing {n} synthetic models of 128 MiB into {}", dir.display());
        (0..n)
            .map(|i| {
                let p = dir.join(format!("model{i}.safetensors"));
                synthetic_model(&p, i + 1).map(|()| p)
            })
            .collect::<anyhow::Result<Vec<_>>>()?
    } else {
        args.models.clone()
    };
    let plan = Plan::with_layout(args.layout.clone());

    // First start: pack everything (written to the cache and handed to the fd store).
    let r = b.start(true)?;
    let t = Instant::now();
    let client = Client::connect(&dir)?;
    let mut keys = Vec::new();
    let mut seg_bytes = 0u64;
    for m in &models {
        let model = client.pack(m, &plan)?;
        seg_bytes += model.info().size;
        keys.push(model.key().to_string());
    }
    let first_pack_s = t.elapsed().as_secs_f64();
    drop(client);
    // The kernels that packed them (the ISA of each layout kind, as picked on this CPU).
    let kernels = b.stats()?.isa;
    let cache = dir.join("cache");
    let deadline = Instant::now() + Duration::from_secs(600);
    while files_in(&cache, packd::persist::cache::EXT).len() < keys.len() {
        if Instant::now() > deadline {
            bail!("the cache files were not written in 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    r.stop()?;

    // Restart (crash, upgrade): the fd store gives every memfd back.
    let (fdstore_ready, fdstore_serving, fdstore_pack_jobs) = b.serve_again(&keys)?;

    // Reboot: no fd store, cold page cache; the cache directory is read and verified.
    // Alternated with the floor: one cold read of the same files on as many threads.
    let mut cold = files_in(&cache, packd::persist::cache::EXT);
    let cache_files = cold.clone();
    cold.extend(models.iter().cloned());
    let (mut reboots, mut floors) = (Vec::new(), Vec::new());
    let (mut cache_ready, mut cache_pack_jobs, mut dropped) = (Duration::ZERO, 0, "");
    for _ in 0..args.runs.max(1) {
        b.manager.clear_store();
        drop_page_cache(&cold, args.keep_page_cache);
        floors.push(cold_read(&cache_files)?.as_secs_f64() * 1e3);
        dropped = drop_page_cache(&cold, args.keep_page_cache);
        let (ready, serving, jobs) = b.serve_again(&keys)?;
        reboots.push(serving.as_secs_f64() * 1e3);
        (cache_ready, cache_pack_jobs) = (ready, jobs);
    }
    let cache_serving = Duration::from_secs_f64(median(reboots.clone()) / 1e3);
    let floor_ms = median(floors.clone());

    // The same with the files still in the page cache (what the copy and checks cost alone).
    b.manager.clear_store();
    let (_, warm_serving, _) = b.serve_again(&keys)?;

    // Baseline: the same restart with nothing persisted: every model is repacked.
    b.manager.clear_store();
    drop_page_cache(&models, args.keep_page_cache);
    let r = b.start(false)?;
    let client = Client::connect(&dir)?;
    for m in &models {
        client.pack(m, &plan)?;
    }
    drop(client);
    let repack_serving = r.spawned.elapsed();
    let repack_pack_jobs = b.pack_jobs()?;
    r.stop()?;
    b.manager.clear_store();

    let stops = b.stops.lock().map_err(|_| anyhow::anyhow!("stop times"))?.clone();
    let strategies = serving_strategies(&cache, page, args.keep_page_cache)?;
    let cpu = adoption_cpu(&cache, page)?;

    let gib = seg_bytes as f64 / f64::from(1u32 << 30);
    let doc = json!({
        "segments": keys.len(),
        "segment_bytes": seg_bytes,
        "ready_empty_ms_median": median(ready_empty.clone()),
        "ready_empty_ms": ready_empty,
        "stop_empty_ms_median": median(stop_empty.clone()),
        "stop_empty_ms": stop_empty,
        "stop_serving_ms_median": median(stops.clone()),
        "stop_serving_ms": stops,
        "first_pack_s": first_pack_s,
        "kernels": kernels,
        "fd_store": {"ready_ms": fdstore_ready.as_secs_f64() * 1e3, "serving_ms": fdstore_serving.as_secs_f64() * 1e3,
                     "pack_jobs": fdstore_pack_jobs},
        "cache_dir": {"ready_ms": cache_ready.as_secs_f64() * 1e3, "serving_ms": cache_serving.as_secs_f64() * 1e3,
                      "s_per_gib": cache_serving.as_secs_f64() / gib, "pack_jobs": cache_pack_jobs, "page_cache": dropped,
                      "warm_serving_ms": warm_serving.as_secs_f64() * 1e3, "serving_ms_runs": reboots,
                      "cold_read_ms": floor_ms, "cold_read_ms_runs": floors,
                      "vs_cold_read": cache_serving.as_secs_f64() * 1e3 / floor_ms.max(1e-9)},
        "repack": {"serving_ms": repack_serving.as_secs_f64() * 1e3, "pack_jobs": repack_pack_jobs},
        "cache_serving_strategies": strategies,
        "adoption_cpu": cpu,
        "huge_pages": packd::sys::proc::huge_pages_note(true),
    });
    if args.json {
        println!("{doc}");
    } else {
        print_table(&doc, gib);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_table(d: &Value, gib: f64) {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    let repack = f(&d["repack"]["serving_ms"]);
    println!("{} segments, {:.2} GiB packed", d["segments"], gib);
    let starts: Vec<String> =
        d["ready_empty_ms"].as_array().map(|a| a.iter().map(|v| format!("{:.1}", f(v))).collect()).unwrap_or_default();
    println!(
        "READY=1 after exec, empty cache: median {:.1} ms (runs: {} ms)",
        f(&d["ready_empty_ms_median"]),
        starts.join(", ")
    );
    println!(
        "SIGTERM to exit: empty and idle {:.1} ms, serving every segment {:.1} ms (medians)",
        f(&d["stop_empty_ms_median"]),
        f(&d["stop_serving_ms_median"])
    );
    println!(
        "{:<42} {:>12} {:>14} {:>10} {:>12}",
        "serving every segment again after", "READY (ms)", "all served (ms)", "pack jobs", "vs repack"
    );
    for (name, k) in [("restart through the fd store", "fd_store"), ("reboot through the cache directory", "cache_dir")]
    {
        let s = f(&d[k]["serving_ms"]);
        println!(
            "{:<42} {:>12.1} {:>14.1} {:>10} {:>11.3}×",
            name,
            f(&d[k]["ready_ms"]),
            s,
            d[k]["pack_jobs"],
            s / repack
        );
    }
    println!(
        "{:<42} {:>12} {:>14.1} {:>10} {:>11.3}×",
        "baseline: repacking every model", "", repack, d["repack"]["pack_jobs"], 1.0
    );
    println!(
        "cache directory: {:.3} s per GiB including verification; page cache {}; with the files in the page cache {:.1} ms",
        f(&d["cache_dir"]["s_per_gib"]),
        d["cache_dir"]["page_cache"].as_str().unwrap_or(""),
        f(&d["cache_dir"]["warm_serving_ms"])
    );
    println!(
        "cache directory vs one cold read of the same files on {} threads: {:.1} ms vs {:.1} ms = {:.2}× (medians of {} alternated runs)",
        read_threads(),
        f(&d["cache_dir"]["serving_ms"]),
        f(&d["cache_dir"]["cold_read_ms"]),
        f(&d["cache_dir"]["vs_cold_read"]),
        d["cache_dir"]["serving_ms_runs"].as_array().map_or(0, Vec::len)
    );
    let c = &d["adoption_cpu"];
    println!(
        "adoption's CPU time, one thread, files in the page cache, s per GiB: read {:.3}; read + BLAKE3 {:.3}; \
         read + copy into a memfd {:.3}; packd's adoption {:.3} (huge pages: {})",
        f(&c["read_s_per_gib"]),
        f(&c["read_blake3_s_per_gib"]),
        f(&c["read_copy_memfd_s_per_gib"]),
        f(&c["adopt_s_per_gib"]),
        d["huge_pages"].as_str().unwrap_or("?"),
    );
    let cold_s_per_gib = f(&d["cache_dir"]["cold_read_ms"]) / 1e3 / gib;
    println!(
        "  on {} cores a reboot needs at least {:.3} s of CPU per GiB = {:.2}× this run's cold read ({:.3} s per GiB)",
        c["cores"],
        f(&c["cpu_floor_s_per_gib"]),
        f(&c["cpu_floor_s_per_gib"]) / cold_s_per_gib.max(1e-9),
        cold_s_per_gib
    );
    let s = &d["cache_serving_strategies"];
    let mib = |v: &Value| v.as_f64().unwrap_or(0.0) / f64::from(1u32 << 20);
    println!("serving the cache files again, one thread, cold page cache ({:.0} MiB):", mib(&s["bytes"]));
    println!(
        "  copied into sealed memfds and verified (packd): {:.3} s; holds {:.0} MiB shared memory + {:.0} MiB page cache",
        f(&s["copy_into_sealed_memfd_s"]),
        mib(&s["copy_shmem_bytes"]),
        mib(&s["copy_page_cache_bytes"])
    );
    println!(
        "  checked in place (file fd served):               {:.3} s; holds {:.0} MiB page cache (copying takes {:.2}× as long)",
        f(&s["map_file_in_place_s"]),
        mib(&s["in_place_page_cache_bytes"]),
        f(&s["copy_into_sealed_memfd_s"]) / f(&s["map_file_in_place_s"]).max(1e-9)
    );
}
