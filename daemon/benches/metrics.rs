//! What one Prometheus scrape costs the daemon at 10 000 entries (500 published segments of
//! 20 entries, 500 models) and 1 000 connections (each leasing 4 segments; one in ten
//! reporting a private model): the whole `/metrics` text rendered, against `GetStats`'s
//! store snapshot alone measured in the same run; and its two parts that walk the store,
//! the per-model figures and the host's sharing.
//!
//!     cargo bench -p packd --bench metrics

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use packd::config::{Args, Config};
use packd::metrics::Metrics;
use packd::server::Parts;
use packd::store::{
    Adopted, Peer, Publisher, Report, published_entry, published_key, published_plan, published_source,
};
use packd_proto::v1::{Fallback, Obtained};

const SEGMENTS: usize = 500;
const ENTRIES_PER_SEGMENT: u64 = 20;
const CONNECTIONS: usize = 1000;

fn world() -> (tempfile::TempDir, Parts) {
    let dir = tempfile::tempdir().expect("temp dir");
    let args = <Args as clap::Parser>::try_parse_from([
        "packd",
        "--socket-dir",
        dir.path().to_str().expect("utf-8"),
        "--max-bytes",
        "64G",
        "--cache-dir",
        "off",
    ])
    .expect("arguments");
    let parts = Parts::wire(&Config::from_args(args).expect("config"));
    let store = &parts.packer.store;
    let mut segments = Vec::new();
    for i in 0..SEGMENTS {
        let identity = format!("xnnpack;key=v1/64b;model=b3:{i:032x};engine=b3:0;cpu=b3:0");
        let source = published_source(0, &identity);
        let size = ENTRIES_PER_SEGMENT * 256;
        let file = memfd::MemfdOptions::default().create("bench").expect("memfd").into_file();
        file.set_len(size.next_multiple_of(4096)).expect("set_len");
        let entries = (0..ENTRIES_PER_SEGMENT)
            .map(|e| published_entry(&source, &format!("op{e}"), e * 256, 200, [e.to_le_bytes()[0]; 32]))
            .collect();
        let seg = store
            .adopt(
                Adopted {
                    file,
                    key: published_key(0, &identity),
                    size: size.next_multiple_of(4096),
                    source,
                    plan: published_plan(0, &identity),
                    entries,
                    publisher: Some(Publisher { uid: 0, gid: 0, groups: vec![], identity: identity.clone() }),
                    label: String::new(),
                },
                false,
                false,
            )
            .expect("adopted");
        segments.push(seg);
    }
    for c in 0..CONNECTIONS {
        let client = store.connect(Peer { pid: i32::try_from(c + 1).ok(), uid: 0, gid: 0 });
        for k in 0..4 {
            store.lease(client, &segments[(c * 7 + k * 131) % SEGMENTS]).expect("lease");
        }
        if c % 10 == 0 {
            store.report(
                client,
                Report {
                    engine: "xnnpack".into(),
                    model: format!("private-{c}"),
                    obtained: Obtained::Private,
                    fallback: Fallback::UnknownInterface,
                    detail: "bench".into(),
                    private_bytes: 1 << 20,
                    shared_bytes: 0,
                    at: std::time::SystemTime::now(),
                },
            );
        }
    }
    assert_eq!(store.stats().entries, SEGMENTS as u64 * ENTRIES_PER_SEGMENT);
    (dir, parts)
}

fn bench(c: &mut Criterion) {
    let (_dir, parts) = world();
    let metrics = Metrics::new(Arc::clone(&parts.control), 50);
    let text = metrics.render();
    eprintln!("one scrape: {} bytes, {} lines", text.len(), text.lines().count());
    let mut g = c.benchmark_group("scrape_10k_entries_1k_connections");
    g.bench_function("baseline_get_stats_snapshot", |b| b.iter(|| parts.packer.store.stats()));
    g.bench_function("store_models", |b| b.iter(|| parts.packer.store.models()));
    g.bench_function("store_sharing", |b| b.iter(|| parts.packer.store.sharing()));
    g.bench_function("metrics_render", |b| b.iter(|| metrics.render()));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
