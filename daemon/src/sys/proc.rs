//! Facts about the system the daemon runs on.

/// Raises this process's soft open-file limit to its hard limit (as systemd advises any
/// program that needs many fds and does not use `select`) and returns the soft limit now
/// in effect. Each segment and each connection is an open fd.
pub fn raise_open_file_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(_) => soft,
        },
        Ok((soft, _)) => soft,
        Err(_) => 1024,
    }
}

/// This process's soft open-file limit.
pub fn open_file_limit() -> u64 {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).map_or(1024, |(soft, _)| soft)
}

/// The system page size.
pub fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|v| u64::try_from(v).ok())
        .unwrap_or(4096)
}

/// Bytes the C allocator holds free (returned by the program, kept for reuse), where it
/// can tell (glibc); 0 elsewhere.
pub fn heap_free_bytes() -> u64 {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallinfo2 takes no arguments and only reads the allocator's statistics.
        let info = unsafe { libc::mallinfo2() };
        info.fordblks as u64
    }
    #[cfg(not(target_env = "gnu"))]
    0
}

/// Gives the C allocator's free memory back to the kernel (glibc keeps freed heap memory
/// for reuse: after a model with a huge tensor table leaves the index, its hundreds of MB
/// would otherwise stay in the daemon's RSS). Takes milliseconds on a large heap: call it
/// off the async runtime.
pub fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas; no
    // pointer the program holds is affected.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Lowers the calling thread's priority to nice 19 (background work that must not slow
/// the requests beside it). Best effort: a failure leaves the priority as it was.
pub fn lower_thread_priority() {
    // SAFETY: gettid takes no arguments and returns the caller's thread id.
    let tid = unsafe { libc::gettid() };
    let Ok(tid) = libc::id_t::try_from(tid) else { return };
    // SAFETY: setpriority with PRIO_PROCESS and a thread id changes that thread's nice
    // value only (Linux); it reads no memory of ours.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
}

/// CPU time the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`): what a measurement
/// that may be descheduled on a busy host should time. Zero if the clock cannot be read.
pub fn thread_cpu_time() -> std::time::Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).map_or(std::time::Duration::ZERO, |t| {
        std::time::Duration::new(u64::try_from(t.tv_sec()).unwrap_or(0), u32::try_from(t.tv_nsec()).unwrap_or(0))
    })
}

/// What `huge_pages` gives on this host, for the start log: the host's shmem setting
/// (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`, the bracketed value) decides.
pub fn huge_pages_note(asked: bool) -> String {
    match (asked, shmem_huge_setting().as_deref()) {
        (false, _) => "off".into(),
        (true, Some(m @ ("advise" | "within_size" | "always" | "force"))) => format!("on (shmem_enabled={m})"),
        (true, Some(m)) => format!("asked, not granted (shmem_enabled={m}: set it to advise to use them)"),
        (true, None) => "asked (no transparent huge pages on this kernel)".into(),
    }
}

/// The host's setting for transparent huge pages in shared memory (the bracketed value of
/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled`); `None` without THP.
fn shmem_huge_setting() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    Some(text.split_once('[')?.1.split_once(']')?.0.to_string())
}

/// Whether this host grants memfds huge pages only through a mapping advised with
/// `MADV_HUGEPAGE` (`shmem_enabled` is advise): then a `write` into a memfd allocates small
/// pages. (With within_size, always or force, writes get huge pages as they are.)
pub fn huge_pages_only_when_advised() -> bool {
    shmem_huge_setting().as_deref() == Some("advise")
}

/// What identifies this CPU for measurements kept across starts: the first processor's
/// vendor, family, model, stepping and name from `/proc/cpuinfo` (x86), or implementer,
/// architecture, variant, part and revision (Arm), on one line. Empty if unreadable.
pub fn cpu_identity() -> String {
    const KEYS: [&str; 10] = [
        "vendor_id",
        "cpu family",
        "model",
        "stepping",
        "model name",
        "CPU implementer",
        "CPU architecture",
        "CPU variant",
        "CPU part",
        "CPU revision",
    ];
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let first = text.split("\n\n").next().unwrap_or("");
    let mut parts = Vec::new();
    for line in first.lines() {
        let Some((key, value)) = line.split_once(':') else { continue };
        let key = key.trim();
        if KEYS.contains(&key) {
            parts.push(format!("{key}={}", value.split_whitespace().collect::<Vec<_>>().join(" ")));
        }
    }
    parts.join("; ")
}

/// This process's cgroup (v2) directory under `/sys/fs/cgroup`, if it can be read.
fn cgroup_dir() -> Option<String> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(format!("/sys/fs/cgroup{}", path.trim()))
}

/// The memory limit of this process's cgroup (v2), if one is set.
pub fn cgroup_memory_limit() -> Option<u64> {
    let max = std::fs::read_to_string(format!("{}/memory.max", cgroup_dir()?)).ok()?;
    max.trim().parse().ok()
}

/// Memory the host can give without coming under pressure: `MemAvailable` less a tenth of
/// `MemTotal` (at least 256 MiB) kept free, and within this process's cgroup limit (less a
/// tenth of it) where one is set. Where `/proc/meminfo` is hidden (`ProcSubset=pid`, as
/// packd's unit runs), the NUMA nodes' meminfo in sysfs gives an estimate of it (free
/// memory, half the page cache and half the reclaimable slab), else `sysinfo(2)` (free RAM
/// only, a lower figure). `None` when none can be read.
pub fn memory_to_spare() -> Option<u64> {
    const FLOOR: u64 = 256 << 20;
    let keep = |total: u64| (total / 10).max(FLOOR);
    let host = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| Some((kib_field(&text, "MemAvailable")?, kib_field(&text, "MemTotal")?)))
        .or_else(nodes_available)
        .or_else(|| {
            let info = nix::sys::sysinfo::sysinfo().ok()?;
            Some((info.ram_unused(), info.ram_total()))
        });
    let mut spare = host.map(|(available, total)| available.saturating_sub(keep(total)));
    if let Some(limit) = cgroup_memory_limit() {
        let used = cgroup_dir()
            .and_then(|d| std::fs::read_to_string(format!("{d}/memory.current")).ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        let room = limit.saturating_sub(used).saturating_sub(keep(limit));
        spare = Some(spare.map_or(room, |s| s.min(room)));
    }
    spare
}

/// A `NAME: N kB` field of a meminfo text (`/proc/meminfo`, or a node's with its
/// `Node N ` prefix), in bytes; summed over the lines that have it.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let mut found = None;
    for line in text.lines() {
        let line = match line.strip_prefix("Node ") {
            Some(rest) => rest.split_once(' ').map_or(rest, |(_, r)| r),
            None => line,
        };
        let Some(value) = line.strip_prefix(name).and_then(|v| v.strip_prefix(':')) else { continue };
        if let Some(kib) = value.trim().strip_suffix("kB").and_then(|v| v.trim().parse::<u64>().ok()) {
            found = Some(found.unwrap_or(0) + (kib << 10));
        }
    }
    found
}

/// What the NUMA nodes' meminfo says is available, and their total: free memory, half
/// the page cache (active and inactive file pages: not `FilePages`, which holds shared
/// memory too) and half the reclaimable slab (the kernel's `MemAvailable` counts those
/// less its watermarks).
fn nodes_available() -> Option<(u64, u64)> {
    let mut text = String::new();
    for entry in std::fs::read_dir("/sys/devices/system/node").ok()?.flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().strip_prefix("node").is_some_and(|n| n.parse::<u32>().is_ok()) {
            text += &std::fs::read_to_string(entry.path().join("meminfo")).unwrap_or_default();
        }
    }
    node_estimate(&text)
}

fn node_estimate(text: &str) -> Option<(u64, u64)> {
    let free = kib_field(text, "MemFree")?;
    let files = kib_field(text, "Active(file)").unwrap_or(0) + kib_field(text, "Inactive(file)").unwrap_or(0);
    let slab = kib_field(text, "SReclaimable").unwrap_or(0);
    Some((free + files / 2 + slab / 2, kib_field(text, "MemTotal")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_are_read_from_the_host_and_summed_over_nodes() {
        let host = "MemTotal:       24684092 kB\nMemFree:         3376700 kB\nMemAvailable:   21874096 kB\n";
        assert_eq!(kib_field(host, "MemAvailable"), Some(21_874_096 << 10));
        assert_eq!(kib_field(host, "Mem"), None);
        let nodes = "Node 0 MemTotal:       1000 kB\nNode 0 MemFree:         100 kB\nNode 0 Active(file):    300 kB\n\
                     Node 0 Inactive(file):  100 kB\nNode 0 FilePages:       900 kB\nNode 0 Shmem:           500 kB\n\
                     Node 0 SReclaimable:     60 kB\nNode 1 MemTotal:       1000 kB\nNode 1 MemFree:         200 kB\n";
        assert_eq!(node_estimate(nodes), Some(((300 + 200 + 30) << 10, 2000 << 10)));
        assert!(memory_to_spare().is_some(), "this host's memory can be read");
    }
}
