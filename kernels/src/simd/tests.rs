//! Every ISA this CPU has produces the scalar reference's bytes.
#![allow(clippy::cast_possible_truncation)] // random bit patterns are truncated on purpose

use proptest::prelude::*;

use super::{Isa, pack_block};
use crate::dtype::Dtype;
use crate::gemm::{pack_block_ref, src_size};
use crate::params::{GemmKind, GemmParams, KR_VALUES, NR_VALUES, SR_VALUES};

const SRCS: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];

/// Interesting f32 bit patterns: NaNs (quiet, signalling, negative, with payloads), ±inf,
/// ±0, subnormals, values that round to ties in f16/bf16, huge and tiny.
const SPECIAL_F32: [u32; 16] = [
    0x7FC0_0000,
    0x7F80_0001,
    0xFFC1_2345,
    0x7FBF_FFFF,
    0x7F80_0000,
    0xFF80_0000,
    0x0000_0000,
    0x8000_0000,
    0x0000_0001,
    0x807F_FFFF,
    0x3F80_8000,
    0x3F81_8000,
    0x477F_F000,
    0x3380_0000,
    0x7F7F_FFFF,
    0x3880_0000,
];
const SPECIAL_16: [u16; 10] = [0x7E00, 0x7C01, 0xFD55, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x83FF, 0x7F81];

/// Source bytes for `n × k` elements of `src`, mixing random values and special patterns.
fn source(src: Dtype, n: usize, k: usize, seed: u64, special_every: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::with_capacity(n * k * src_size(src));
    for i in 0..n * k {
        let r = next();
        let special = special_every > 0 && i % special_every == 0;
        if src == Dtype::F32 {
            let bits = if special {
                SPECIAL_F32[(r % 16) as usize]
            } else {
                // Random sign and mantissa, exponents near 1 with a spread.
                let exp = 112 + (r >> 40) % 32;
                ((r >> 8) as u32 & 0x807F_FFFF) | ((exp as u32) << 23)
            };
            out.extend_from_slice(&bits.to_le_bytes());
        } else {
            let bits = if special {
                SPECIAL_16[(r % 10) as usize]
            } else if src == Dtype::F16 {
                ((r >> 8) as u16 & 0x83FF) | ((8 + (r >> 40) as u16 % 14) << 10)
            } else {
                ((r >> 8) as u16 & 0x807F) | ((112 + (r >> 40) as u16 % 32) << 7)
            };
            out.extend_from_slice(&bits.to_le_bytes());
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn check(
    isa: Isa,
    kind: GemmKind,
    p: GemmParams,
    src: Dtype,
    nb: usize,
    k: usize,
    seed: u64,
    special: usize,
) -> Result<(), TestCaseError> {
    let rows = source(src, nb, k, seed, special);
    let len = kind.block_len(p, k);
    let mut want = vec![0x5Au8; len];
    pack_block_ref(kind, p, src, k, &rows, &mut want);
    // The block at a cache-line boundary (the kernels' streaming stores) and 16 bytes past
    // one (their unaligned stores).
    let mut buf = vec![0x5Au8; len + 128];
    for skew in [0, 16] {
        let start = buf.as_ptr().align_offset(64) + skew;
        let got = &mut buf[start..start + len];
        got.fill(0x5A);
        pack_block(isa, kind, p, src, k, &rows, got);
        if *got != want[..] {
            let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            return Err(TestCaseError::fail(format!(
                "{isa} {} {p:?} src {src} nb={nb} k={k} skew={skew}: first difference at byte {at}: got {:02x?} want {:02x?}",
                kind.name(),
                &got[at..(at + 8).min(len)],
                &want[at..(at + 8).min(len)]
            )));
        }
    }
    Ok(())
}

fn params() -> impl Strategy<Value = GemmParams> {
    (0..NR_VALUES.len(), 0..KR_VALUES.len(), 0..SR_VALUES.len()).prop_map(|(a, b, c)| GemmParams {
        nr: NR_VALUES[a],
        kr: KR_VALUES[b],
        sr: SR_VALUES[c],
    })
}

/// The ISAs the kernel tests must run on, from the CPU's flags as the kernel reports them
/// in `/proc/cpuinfo` (read apart from the feature detection the kernels use): every
/// machine packd is tested on has AVX2 (x86_64) or NEON (aarch64); AVX-512 where the CPU
/// has F, BW and VL.
fn isas_expected() -> Vec<&'static str> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags") || l.starts_with("Features"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, f)| f.split_whitespace().collect())
        .unwrap_or_default();
    let has = |all: &[&str]| all.iter().all(|f| flags.contains(f));
    let mut want = vec!["scalar"];
    if cfg!(target_arch = "x86_64") {
        want.push("avx2");
        if has(&["avx512f", "avx512bw", "avx512vl"]) {
            want.push("avx512");
        }
    }
    if cfg!(target_arch = "aarch64") {
        want.push("neon");
    }
    want
}

/// Names the ISAs every test here runs on this CPU (CI shows it with `--show-output`): all
/// the CPU's flags say it has, AVX-512 included where it has it.
#[test]
fn isas_tested() {
    let names: Vec<String> = Isa::available().iter().map(ToString::to_string).collect();
    println!("kernel tests run on: {}", names.join(", "));
    assert_eq!(names, isas_expected(), "the CPU's flags ask for these ISAs");
}

#[test]
fn the_cpu_has_an_isa_and_parse_refuses_unknowns() {
    assert!(!Isa::available().is_empty());
    assert!(Isa::parse("scalar").is_ok());
    assert_eq!(Isa::parse("sse9").unwrap_err(), super::IsaError::Unknown("sse9".into()));
    #[cfg(target_arch = "x86_64")]
    assert!(matches!(Isa::parse("neon").unwrap_err(), super::IsaError::Unsupported { .. }));
}

#[test]
fn odd_shapes_every_param_every_dtype() {
    let dims = [1usize, 2, 3, 7, 15, 17, 63, 65, 257];
    for isa in Isa::available() {
        for kind in GemmKind::ALL {
            for src in SRCS {
                for &nr in &NR_VALUES {
                    for &kr in &KR_VALUES {
                        for &sr in &SR_VALUES {
                            let p = GemmParams { nr, kr, sr };
                            for (i, &k) in dims.iter().enumerate() {
                                // Full and partial blocks, and an empty one.
                                for nb in [nr as usize, (i * 5) % nr as usize, 0] {
                                    check(isa, kind, p, src, nb, k, (i * 31 + nb) as u64 + 7, 5).unwrap();
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Rows long enough for the streaming paths (prefetch ahead, staging tiles, several
/// 32-column tiles and a tail) on every kind, source dtype and `nr`, full blocks.
#[test]
fn long_rows_every_kind_every_dtype() {
    for isa in Isa::available() {
        for kind in GemmKind::ALL {
            for src in SRCS {
                for &nr in &NR_VALUES {
                    for (i, k) in [1024usize, 4096 + 8, 4133].into_iter().enumerate() {
                        let p = GemmParams { nr, kr: 1, sr: 1 };
                        check(isa, kind, p, src, nr as usize, k, i as u64 * 97 + u64::from(nr), 7).unwrap();
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_blocks_match_the_reference(
        p in params(),
        kind in 0..4usize,
        src in 0..3usize,
        nb_frac in 0.0f64..=1.0,
        k in 0usize..300,
        seed in any::<u64>(),
        special in prop_oneof![Just(0usize), Just(1usize), 2usize..20],
    ) {
        let nb = ((p.nr as f64) * nb_frac).round() as usize;
        for isa in Isa::available() {
            check(isa, GemmKind::ALL[kind], p, SRCS[src], nb, k, seed, special)?;
        }
    }
}
