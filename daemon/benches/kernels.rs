//! Criterion benchmarks of the packing kernels: every layout at its default parameters on
//! every ISA this CPU has, packing a 1024 × 1024 f32 matrix (4 MiB, cache-warm).
//! `cargo bench -p packd --bench kernels`. For the memory-bound figures against memcpy use
//! `packctl bench pack`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use packd::pack::kernels::pack_matrix;
use packd::pack::{GemmKind, GemmParams, Isa, Layout};
use packd::source::Dtype;

fn kernels(c: &mut Criterion) {
    let (n, k) = (1024usize, 1024usize);
    let src: Vec<u8> = (0..n * k).flat_map(|i| ((i % 977) as f32 * 0.001 - 0.5).to_le_bytes()).collect();
    for kind in GemmKind::ALL {
        let p = GemmParams::default();
        let len = Layout::Gemm(kind, p).packed_len(n, k, 0).and_then(|l| usize::try_from(l).ok()).unwrap_or(0);
        let mut dst = vec![0u8; len];
        let mut group = c.benchmark_group(kind.name());
        group.throughput(Throughput::Bytes(len as u64));
        for isa in Isa::available() {
            group.bench_function(isa.to_string(), |b| {
                b.iter(|| pack_matrix(isa, kind, p, Dtype::F32, k, std::hint::black_box(&src), &mut dst))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, kernels);
criterion_main!(benches);
