//! `packctl stats` for people: the daemon's counters in groups (service, memory, packing,
//! workers, engines' sharing), one line per fact, sizes in KiB/MiB/GiB and times as
//! durations. `--json` prints the counters as they are (control.rs).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use packd_proto::units::format_size;
use packd_proto::v1 as pb;

/// What the workers connected now report, by engine: (served, built, private).
pub type ByEngine = BTreeMap<String, (u64, u64, u64)>;

/// Counts the reports of `clients` by engine.
pub fn by_engine(clients: &[pb::ClientStatus]) -> ByEngine {
    let mut by: ByEngine = BTreeMap::new();
    for w in clients.iter().flat_map(|c| &c.reports) {
        let Some(r) = &w.report else { continue };
        let n = by.entry(if r.engine.is_empty() { "unnamed".to_string() } else { r.engine.clone() }).or_default();
        match r.obtained() {
            pb::Obtained::Served => n.0 += 1,
            pb::Obtained::Built => n.1 += 1,
            pb::Obtained::Private => n.2 += 1,
            pb::Obtained::Unspecified => {}
        }
    }
    by
}

/// A duration for people: `850 ms`, `14.4 s`, `3 min 05 s`, `2 h 03 min`, `4 d 02 h`.
pub fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "-".to_string();
    }
    if secs < 1.0 {
        return format!("{:.0} ms", secs * 1000.0);
    }
    if secs < 60.0 {
        return format!("{secs:.1} s");
    }
    // Whole seconds from here (the value is finite, non-negative and shown rounded).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let s = secs.round() as u64;
    match s {
        ..3600 => format!("{} min {:02} s", s / 60, s % 60),
        3600..86_400 => format!("{} h {:02} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {:02} h", s / 86_400, s % 86_400 / 3600),
    }
}

/// Which ISA packs which layout kind, grouped by ISA: `avx512: f16-gemm bf16-gemm ·
/// avx2: f32-gemm qc8w-gemm` (one ISA: `avx2 for every layout kind`).
pub fn kernels(s: &pb::Stats) -> String {
    if s.kernels.is_empty() {
        return s.isa.clone();
    }
    let mut by_isa: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (kind, isa) in &s.kernels {
        by_isa.entry(isa).or_default().push(kind);
    }
    if by_isa.len() == 1 {
        return format!("{} for every layout kind", by_isa.keys().next().copied().unwrap_or_default());
    }
    by_isa.values_mut().for_each(|kinds| kinds.sort_unstable());
    let mut groups: Vec<(&str, Vec<&str>)> = by_isa.into_iter().collect();
    groups.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(b.0)));
    groups.iter().map(|(isa, kinds)| format!("{isa}: {}", kinds.join(" "))).collect::<Vec<_>>().join(" · ")
}

/// The text of `packctl stats`.
pub fn text(s: &pb::Stats, engines: &ByEngine, exact: bool) -> String {
    let size = |n: u64| if exact { format!("{n} bytes") } else { format_size(n) };
    let mut groups: Vec<(&str, Vec<(&str, String)>)> = Vec::new();
    groups.push((
        "service",
        vec![
            ("uptime", duration(s.uptime_seconds)),
            ("clients", format!("{} connected ({} leases held)", s.clients, s.leases)),
            (
                "connections refused",
                format!("{} at the limits, {} shed under load", s.connections_refused, s.connections_shed),
            ),
            (
                "control plane",
                format!("{} connected, {} refused", s.control_connections, s.control_connections_refused),
            ),
            ("request errors", s.request_errors.to_string()),
            ("log lines suppressed", s.log_lines_suppressed.to_string()),
        ],
    ));
    let spare = if s.spare_bytes > 0 {
        format!("{} ready for the next pack job (taken {} times)", size(s.spare_bytes), s.spare_takes)
    } else {
        format!("none now: made after the first pack job, unless spare_bytes is off (taken {} times)", s.spare_takes)
    };
    groups.push((
        "memory",
        vec![
            ("resident", format!("{} of a {} budget", size(s.bytes_resident), size(s.budget_bytes))),
            ("spare", spare),
            ("evicted, still mapped", size(s.zombie_bytes)),
            ("reserved for adoption", size(s.reserved_bytes)),
        ],
    ));
    groups.push((
        "packing",
        vec![
            ("segments", format!("{} ({} entries)", s.segments, s.entries)),
            (
                "pack jobs",
                format!("{} ({} failed), {} packing", s.pack_jobs, s.pack_failures, duration(s.pack_seconds)),
            ),
            ("lookups", format!("{} hits, {} misses", s.hits, s.misses)),
            ("sources hashed", s.source_hashes.to_string()),
            ("duplicates dropped", s.duplicates_dropped.to_string()),
            ("evictions", s.evictions.to_string()),
            ("kernels", kernels(s)),
            ("why these kernels", if s.kernels_reason.is_empty() { "-".to_string() } else { s.kernels_reason.clone() }),
        ],
    ));
    let mut fallbacks: Vec<(&String, &u64)> = s.private_fallbacks.iter().filter(|(_, n)| **n > 0).collect();
    fallbacks.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let fallbacks = if fallbacks.is_empty() {
        "none".to_string()
    } else {
        fallbacks.iter().map(|(r, n)| format!("{r} {n}")).collect::<Vec<_>>().join(", ")
    };
    let mut workers = vec![
        (
            "workers",
            format!(
                "{} served, {} building, {} private ({} held privately)",
                s.workers_served,
                s.workers_building,
                s.workers_private,
                size(s.private_bytes)
            ),
        ),
        ("mapped", format!("{} by all workers, {} saved by sharing", size(s.bytes_mapped), size(s.bytes_saved))),
        ("private fallbacks", fallbacks),
        ("reports", format!("{} ({} dropped)", s.worker_reports, s.worker_reports_dropped)),
    ];
    for (engine, (served, built, private)) in engines {
        workers.push(("", format!("{engine}: {served} served, {built} built, {private} private")));
    }
    if let Some(first) = workers.iter_mut().find(|(k, _)| k.is_empty()) {
        first.0 = "by engine (connected)";
    }
    groups.push(("workers", workers));
    groups.push((
        "engines' sharing",
        vec![
            ("published", format!("{} segments, {}", s.published_segments, size(s.published_bytes))),
            (
                "publishes",
                format!(
                    "{} ({} refused, {} withdrawn), {} aliases filed",
                    s.publishes, s.publishes_refused, s.publishes_withdrawn, s.aliases_filed
                ),
            ),
            ("builder roles", format!("{} given, {} active, {} refused", s.builds, s.builds_active, s.builds_refused)),
            (
                "builds ended unpublished",
                format!(
                    "{} abandoned, {} expired, {} given up",
                    s.builds_abandoned, s.builds_expired, s.builds_given_up
                ),
            ),
            ("waits for a build", format!("{} ({} judged slow)", s.build_waits, s.build_waits_slow)),
            (
                "memory lent to builders",
                format!(
                    "{} now; {} builds lent, {} refused, {} revoked, {} expired",
                    size(s.lent_bytes),
                    s.builds_lent,
                    s.lends_refused,
                    s.lends_revoked,
                    s.lends_expired
                ),
            ),
            ("private reports", s.private_reports.to_string()),
        ],
    ));
    let width = groups.iter().flat_map(|(_, lines)| lines.iter().map(|(k, _)| k.len())).max().unwrap_or(0);
    let mut out = String::new();
    for (name, lines) in groups {
        let _ = writeln!(out, "{name}");
        for (k, v) in lines {
            let _ = writeln!(out, "  {k:<width$}  {v}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_say_them() {
        for (secs, want) in [
            (0.0, "0 ms"),
            (0.85, "850 ms"),
            (14.386_232_497, "14.4 s"),
            (185.0, "3 min 05 s"),
            (7380.0, "2 h 03 min"),
            (352_800.0, "4 d 02 h"),
            (f64::NAN, "-"),
        ] {
            assert_eq!(duration(secs), want, "{secs}");
        }
    }

    #[test]
    fn kernels_are_one_line_grouped_by_isa() {
        let mut s = pb::Stats { isa: "avx2".into(), ..Default::default() };
        assert_eq!(kernels(&s), "avx2", "an older daemon's isa");
        for (kind, isa) in
            [("f32-gemm", "avx2"), ("f16-gemm", "avx512"), ("bf16-gemm", "avx512"), ("qc8w-gemm", "avx2")]
        {
            s.kernels.insert(kind.into(), isa.into());
        }
        assert_eq!(kernels(&s), "avx2: f32-gemm qc8w-gemm · avx512: bf16-gemm f16-gemm");
        s.kernels.values_mut().for_each(|v| *v = "avx2".into());
        assert_eq!(kernels(&s), "avx2 for every layout kind");
    }

    #[test]
    fn the_text_is_grouped_one_fact_a_line_with_the_spare_explained() {
        let s = pb::Stats {
            uptime_seconds: 14.386_232_497,
            bytes_resident: 90 << 20,
            budget_bytes: 12 << 30,
            isa: "avx2 avx512".into(),
            ..Default::default()
        };
        let mut engines = ByEngine::new();
        engines.insert("llama.cpp".into(), (3, 1, 0));
        engines.insert("litert".into(), (0, 0, 2));
        let t = text(&s, &engines, false);
        let heads: Vec<&str> = t.lines().filter(|l| !l.starts_with(' ')).collect();
        assert_eq!(heads, ["service", "memory", "packing", "workers", "engines' sharing"], "{t}");
        assert!(t.contains("  uptime ") && t.contains(" 14.4 s\n"), "{t}");
        assert!(t.contains(" 90.0 MiB of a 12.0 GiB budget\n"), "{t}");
        assert!(t.contains(" none now: made after the first pack job"), "{t}");
        assert!(
            t.contains(" by engine (connected) ") && t.contains(" llama.cpp: 3 served, 1 built, 0 private\n"),
            "{t}"
        );
        assert!(t.contains(" litert: 0 served, 0 built, 2 private\n"), "{t}");
        assert!(!t.contains("isa") && t.lines().filter(|l| l.trim_start().starts_with("kernels ")).count() == 1, "{t}");
        // Every value starts in one column.
        let column = |l: &str| l.len() - l[2..].split_once("  ").map_or(0, |(_, v)| v.trim_start().len());
        let columns: std::collections::BTreeSet<usize> =
            t.lines().filter(|l| l.starts_with("  ")).map(column).collect();
        assert_eq!(columns.len(), 1, "{t}");
        let exact = text(&pb::Stats { spare_bytes: 4096, spare_takes: 2, ..s }, &ByEngine::new(), true);
        assert!(exact.contains(" 4096 bytes ready for the next pack job (taken 2 times)"), "{exact}");
    }
}
