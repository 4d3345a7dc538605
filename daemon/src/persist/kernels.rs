//! The kernels file: the kernel measurement kept for this CPU, so that a later start, or
//! another daemon sharing the file, measures nothing (see `pack::choice`). By default
//! `CACHE_DIR/kernels`; `kernels_file` names another (test daemons share one).
//!
//! Text: the line `packd-kernels-v2` (v1 files may hold figures of unoptimised debug
//! kernels, and are measured again), a line `cpu IDENTITY` (the CPU's identity, packd's
//! version and the ISAs measured), then one line per measurement, `KIND ISA GBPS`. Written
//! to a temporary file and renamed over the old one. A file whose identity differs (another
//! CPU, another packd, other candidates) or that does not parse is measured again and
//! replaced. Debug and release builds share it: their kernels are the same optimised code.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::pack::Isa;
use crate::pack::choice::{self, How, IsaSetting, KernelChoice};
use crate::service::Packer;

/// The file's name in the cache directory.
pub const NAME: &str = "kernels";
const MAGIC: &str = "packd-kernels-v2";
/// Largest file read.
const MAX_BYTES: u64 = 64 << 10;

/// The identity a kept measurement must match: CPU, packd version, ISAs compared.
fn identity(candidates: &[Isa]) -> String {
    let isas: Vec<String> = candidates.iter().map(ToString::to_string).collect();
    format!("{}; packd {}; isas {}", crate::sys::proc::cpu_identity(), env!("CARGO_PKG_VERSION"), isas.join(","))
}

/// The kernels a start uses, chosen without measuring: the forced ISA, the single
/// candidate, the measurement kept in `file` for this CPU and these candidates, else the
/// default among the candidates, marked pending ([`measure_later`] then measures).
/// Blocking (reads a small file).
pub fn at_start(setting: &IsaSetting, file: Option<&Path>) -> KernelChoice {
    if let Some(choice) = KernelChoice::without_measuring(setting) {
        return choice;
    }
    let candidates = setting.candidates();
    file.and_then(|f| read(f, &identity(&candidates), &candidates))
        .unwrap_or_else(|| KernelChoice::default_among(&candidates, true))
}

/// What a start would pick, and why (`packd --check-config`). Blocking (reads a file).
pub fn preview(setting: &IsaSetting, file: Option<&Path>) -> String {
    let choice = at_start(setting, file);
    if let How::Pending { candidates } = &choice.how {
        let isas: Vec<String> = candidates.iter().map(ToString::to_string).collect();
        let kept = file.map_or("kept nowhere: kernels_file is off".to_string(), |f| format!("kept in {}", f.display()));
        return format!(
            "{choice} at start, then the fastest of {} measured off the start path (a fraction of a second at low priority; {kept})",
            isas.join(", ")
        );
    }
    format!("{choice} ({})", choice.reason())
}

/// When the kernels in use are the pending default, measures the candidates on a thread of
/// its own at low priority, then makes the result the kernels of pack jobs that start
/// after it and keeps it in `file`. Daemons sharing `file` measure one at a time, and one
/// that finds a measurement kept by another while it waited uses that one.
pub fn measure_later(packer: &Arc<Packer>, file: Option<PathBuf>) {
    let start = packer.kernels.get();
    let How::Pending { candidates } = &start.how else { return };
    let (keeper, isas) = (Arc::clone(packer), candidates.clone());
    let spawned = std::thread::Builder::new().name("packd-kernels".into()).spawn(move || {
        crate::sys::proc::lower_thread_priority();
        let measured = std::panic::catch_unwind(|| measure_and_keep(&isas, file.as_deref()));
        let choice = measured.unwrap_or_else(|_| {
            tracing::error!("kernels: the measurement failed; the default stays in use");
            KernelChoice::default_among(&isas, false)
        });
        if matches!(choice.how, How::Measured { .. }) {
            tracing::info!(kernels = %choice, why = %choice.reason(), "kernels measured");
        } else {
            tracing::info!(kernels = %choice, why = %choice.reason(), "kernels chosen");
        }
        keeper.kernels.set(choice);
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "kernels: cannot start the measurement; the default stays in use");
        packer.kernels.set(KernelChoice::default_among(candidates, false));
    }
}

/// Measures `candidates` unless `file` already keeps their measurement for this CPU (read
/// again under the lock), and keeps the result there. Blocking.
pub fn measure_and_keep(candidates: &[Isa], file: Option<&Path>) -> KernelChoice {
    let id = identity(candidates);
    // One measurement at a time per directory: a flock on the directory itself (no file
    // is added to it), dropped with the handle or the process.
    let dir = file.map(|f| f.parent().unwrap_or(Path::new(".")));
    let _lock = dir.and_then(|d| {
        let _ = super::files::create_private_dir(d);
        let handle = fs::File::open(d).ok()?;
        handle.lock().ok().map(|()| handle)
    });
    if let Some(kept) = file.and_then(|f| read(f, &id, candidates)) {
        return kept;
    }
    let choice = KernelChoice::measure(candidates);
    if let Some(path) = file {
        let text = format!("{MAGIC}\ncpu {id}\n{}", choice::encode_table(choice.table()));
        if let Err(e) = write(path, &text) {
            tracing::warn!(file = %path.display(), error = %e, "kernels: cannot keep the measurement; the next start measures again");
        }
    }
    choice
}

/// The kept measurement in `path` if it is for `id` and names every candidate on every kind.
fn read(path: &Path, id: &str, candidates: &[Isa]) -> Option<KernelChoice> {
    let text = String::from_utf8(super::files::read_regular(path, MAX_BYTES).ok()?).ok()?;
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
    super::files::create_private_dir(dir)?;
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| std::io::Error::other("no file name"))?;
    super::files::replace_file(dir, name, text.as_bytes())
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
        let c = at_start(&IsaSetting::Forced(Isa::scalar()), None);
        assert_eq!((c.how, c.kernels), (How::Forced, crate::pack::Kernels::all(Isa::scalar())));
        let one = at_start(&IsaSetting::Among(vec![Isa::best()]), None);
        assert_eq!((one.how, one.kernels), (How::Only, crate::pack::Kernels::all(Isa::best())));
    }

    #[test]
    fn two_candidates_start_with_the_default_then_measure_once_and_keep_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sub").join(NAME);
        let candidates = vec![Isa::scalar(), Isa::best()];
        let setting = IsaSetting::Among(candidates.clone());
        if Isa::best() == Isa::scalar() {
            return;
        }
        let start = at_start(&setting, Some(&file));
        assert_eq!(start.how, How::Pending { candidates: candidates.clone() });
        assert_eq!(start.kernels, crate::pack::Kernels::all(KernelChoice::default_isa(&candidates)));
        assert!(preview(&setting, Some(&file)).contains("measured off the start path"));
        let measured = measure_and_keep(&candidates, Some(&file));
        assert!(matches!(measured.how, How::Measured { .. }), "{measured:?}");
        assert_eq!(measured.table().len(), 4 * candidates.len());
        let again = at_start(&setting, Some(&file));
        assert!(matches!(again.how, How::Cached { .. }), "{again:?}");
        assert_eq!(again.kernels, measured.kernels, "a later start uses the kept measurement");
        // Under the lock, a kept measurement is used rather than measured again.
        let kept = measure_and_keep(&candidates, Some(&file));
        assert!(matches!(kept.how, How::Cached { .. }), "{kept:?}");
        // Other candidates are another identity.
        let auto = at_start(&IsaSetting::Auto, Some(&file));
        assert!(!matches!(auto.how, How::Cached { .. }), "{auto:?}");
    }
}
