//! File `kernels` in the cache directory: the kernel measurement of an earlier start, so a
//! restart on the same CPU measures nothing (see `pack::choice`).
//!
//! Text: the line `packd-kernels-v1`, a line `cpu IDENTITY` (the CPU's identity, packd's
//! version and the ISAs measured), then one line per measurement, `KIND ISA GBPS`. Written
//! to a temporary file and renamed over the old one. A file whose identity differs (another
//! CPU, another packd) or that does not parse is measured again and replaced.

use std::fs;
use std::path::Path;

use crate::pack::Isa;
use crate::pack::choice::{self, KernelChoice};

/// The file's name in the cache directory.
pub const NAME: &str = "kernels";
const MAGIC: &str = "packd-kernels-v1";
/// Largest file read.
const MAX_BYTES: u64 = 64 << 10;

/// The identity a kept measurement must match: CPU, packd version, ISAs compared.
fn identity(candidates: &[Isa]) -> String {
    let isas: Vec<String> = candidates.iter().map(ToString::to_string).collect();
    format!("{}; packd {}; isas {}", crate::sys::proc::cpu_identity(), env!("CARGO_PKG_VERSION"), isas.join(","))
}

/// What a start would pick, without measuring (`packd --check-config`): the forced ISA, the
/// only candidate, or the measurement kept in `cache_dir` for this CPU; else says that the
/// first start measures. Blocking (reads a small file).
pub fn preview(forced: Option<Isa>, cache_dir: Option<&Path>) -> String {
    let known = forced.map(KernelChoice::forced).or_else(KernelChoice::without_measuring).or_else(|| {
        let candidates = KernelChoice::candidates();
        read(&cache_dir?.join(NAME), &identity(&candidates), &candidates)
    });
    match known {
        Some(choice) => format!("{choice} ({})", choice.reason()),
        None => {
            let isas: Vec<String> = KernelChoice::candidates().iter().map(ToString::to_string).collect();
            format!(
                "measured at start among {} (about a second; kept in the cache directory for later starts)",
                isas.join(", ")
            )
        }
    }
}

/// The kernels for this start: `forced` when given; the single candidate when the CPU has
/// one SIMD ISA; else the measurement kept in `cache_dir` for this CPU, or a new one (kept
/// there when the directory is writable). Blocking (reads and writes a file, measures).
pub fn choose(forced: Option<Isa>, cache_dir: Option<&Path>) -> KernelChoice {
    if let Some(isa) = forced {
        return KernelChoice::forced(isa);
    }
    if let Some(only) = KernelChoice::without_measuring() {
        return only;
    }
    let candidates = KernelChoice::candidates();
    let id = identity(&candidates);
    let path = cache_dir.map(|d| d.join(NAME));
    if let Some(kept) = path.as_deref().and_then(|p| read(p, &id, &candidates)) {
        return kept;
    }
    let choice = KernelChoice::measure(&candidates);
    tracing::info!(kernels = %choice, why = %choice.reason(), "kernels measured");
    if let Some(path) = path {
        let text = format!("{MAGIC}\ncpu {id}\n{}", choice::encode_table(choice.table()));
        if let Err(e) = write(&path, &text) {
            tracing::warn!(file = %path.display(), error = %e, "kernels: cannot keep the measurement; the next start measures again");
        }
    }
    choice
}

/// The kept measurement in `path` if it is for `id` and names every candidate on every kind.
fn read(path: &Path, id: &str, candidates: &[Isa]) -> Option<KernelChoice> {
    let text = String::from_utf8(super::read_regular(path, MAX_BYTES).ok()?).ok()?;
    let rest = text.strip_prefix(MAGIC)?.strip_prefix('\n')?;
    let (cpu, table) = rest.split_once('\n')?;
    if cpu.strip_prefix("cpu ")? != id {
        tracing::info!(file = %path.display(), "kernels: kept measurement is for another CPU or packd; measuring again");
        return None;
    }
    let table = choice::decode_table(table)?;
    let complete = crate::pack::GemmKind::ALL
        .iter()
        .all(|k| candidates.iter().all(|i| table.iter().any(|m| m.kind == *k && m.isa == *i)));
    complete.then(|| KernelChoice::from_table(table, true))
}

fn write(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    super::create_private_dir(dir)?;
    let tmp = dir.join(format!(".{NAME}.tmp.{}", std::process::id()));
    std::io::Write::write_all(&mut super::create_private(&tmp)?, text.as_bytes())?;
    fs::rename(&tmp, path).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::GemmKind;
    use crate::pack::choice::{How, Measurement};

    #[test]
    fn a_kept_measurement_is_used_only_for_its_cpu_and_candidates() {
        let dir = tempfile::tempdir().unwrap();
        // The first file written may create the cache directory: private, whatever the umask.
        let path = dir.path().join("cache").join(NAME);
        let isas = Isa::available();
        let table: Vec<Measurement> = GemmKind::ALL
            .iter()
            .flat_map(|&kind| {
                isas.iter().enumerate().map(move |(i, &isa)| Measurement { kind, isa, gbps: 1.0 + i as f64 })
            })
            .collect();
        let id = identity(&isas);
        write(&path, &format!("{MAGIC}\ncpu {id}\n{}", choice::encode_table(&table))).unwrap();
        let mode = |p: &Path| std::os::unix::fs::PermissionsExt::mode(&fs::metadata(p).unwrap().permissions()) & 0o777;
        assert_eq!((mode(path.parent().unwrap()), mode(&path)), (0o700, 0o600));
        let kept = read(&path, &id, &isas).expect("read back");
        assert!(matches!(kept.how, How::Cached { .. }));
        assert_eq!(kept.table(), &table[..]);
        assert_eq!(kept.kernels.for_kind(GemmKind::F16), *isas.last().unwrap(), "the fastest (last) wins");
        assert!(read(&path, &format!("{id}x"), &isas).is_none(), "another CPU measures again");
        fs::write(&path, format!("{MAGIC}\ncpu {id}\nf32-gemm scalar 1\n")).unwrap();
        assert!(read(&path, &id, &isas).is_none() || isas == [Isa::scalar()], "an incomplete table measures again");
        fs::write(&path, "garbage").unwrap();
        assert!(read(&path, &id, &isas).is_none());
        assert!(identity(&isas).contains(env!("CARGO_PKG_VERSION")));
    }

    #[test]
    fn forced_and_single_candidates_measure_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let c = choose(Some(Isa::scalar()), Some(dir.path()));
        assert_eq!((c.how, c.kernels), (How::Forced, crate::pack::Kernels::all(Isa::scalar())));
        assert!(!dir.path().join(NAME).exists());
    }
}
