//! The engine a provider serves: its build (for the cache identity), the CPU it runs on, and
//! the weights-cache interface its XNNPACK speaks, told from the library loaded in this
//! process.

#![forbid(unsafe_code)]

use std::fs::File;

use crate::sys::dl::Loaded;

use crate::cache::round_up;

/// A digest of what XNNPACK dispatches on: the CPU's vendor, family, model and feature
/// flags (x86) or implementer, part and features (Arm), from `/proc/cpuinfo`.
pub fn cpu_identity() -> String {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let first = text.split("\n\n").next().unwrap_or_default();
    let keys = [
        "vendor_id",
        "cpu family",
        "model",
        "flags",
        "Features",
        "CPU implementer",
        "CPU architecture",
        "CPU variant",
        "CPU part",
    ];
    let mut h = blake3::Hasher::new();
    h.update(std::env::consts::ARCH.as_bytes());
    for line in first.lines() {
        if let Some((k, v)) = line.split_once(':')
            && keys.contains(&k.trim())
        {
            h.update(k.trim().as_bytes());
            h.update(b"=");
            h.update(v.trim().as_bytes());
            h.update(b"\n");
        }
    }
    h.finalize().to_hex()[..32].to_string()
}

/// The path of the file mapped at `addr` in this process (the library holding a function).
fn library_at(addr: usize) -> Option<String> {
    crate::maps::at(addr).map(|m| m.path).filter(|p| p.starts_with('/'))
}

/// The build of the engine whose code lies at `addr`: the GNU build-id of the ELF file
/// mapped there, or (without one) the BLAKE3 of that file, and XNNPACK's own build
/// identifier where the library exports it. `None` if no file maps `addr`.
pub fn engine_identity(addr: usize) -> Option<String> {
    let path = library_at(addr)?;
    let file = File::open(&path).ok()?;
    let name = std::path::Path::new(&path).file_name()?.to_string_lossy().into_owned();
    let read = |offset: u64, len: usize| {
        let mut buf = vec![0u8; len];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, offset).ok().map(|()| buf)
    };
    let file_id = match elf_build_id(read) {
        Some(id) => format!("{name}@id:{id}"),
        None => format!("{name}@b3:{}", &blake3::hash(&std::fs::read(&path).ok()?).to_hex()[..32]),
    };
    Some(match Loaded::open(&path).and_then(|lib| lib.xnn_build_identifier()) {
        Some(xnn) => format!("{file_id};xnn:{xnn}"),
        None => file_id,
    })
}

/// XNNPACK's weights-cache interfaces packd knows, by the year and month they appeared.
pub const INTERFACES: [u32; 3] = [202_411, 202_511, 202_603];

/// The weights-cache interface of the XNNPACK whose code lies at `addr`, told by the
/// symbols its library exports: `xnn_weights_cache_alias_data` came with `alias_data`
/// (2026-03), `xnn_check_fingerprint` with `fingerprint_id` (2025-11);
/// `xnn_create_weights_cache_with_size` and `xnn_create_runtime_v4` without them are the
/// 2024-11 interface. For a provider filled at run time, for an engine packd was not
/// compiled against (where `packd_xnnpack.h` checks the engine's header instead). An error
/// says why the library is not one packd knows.
pub fn engine_interface(addr: usize) -> Result<u32, String> {
    let path = library_at(addr).ok_or_else(|| format!("no library is mapped at {addr:#x}"))?;
    let lib = Loaded::open(&path).ok_or_else(|| format!("{path} is not a loaded library"))?;
    let has = |name: &std::ffi::CStr| lib.has(name);
    if !has(c"xnn_create_runtime_v4") || !has(c"xnn_create_weights_cache_with_size") {
        return Err(format!(
            "{path} exports no XNNPACK with a weights-cache provider (xnn_create_runtime_v4, \
             xnn_create_weights_cache_with_size)"
        ));
    }
    Ok(match (has(c"xnn_check_fingerprint"), has(c"xnn_weights_cache_alias_data")) {
        (false, false) => 202_411,
        (true, false) => 202_511,
        (true, true) => 202_603,
        (false, true) => {
            return Err(format!("{path} has alias_data but no fingerprint API: an XNNPACK packd does not know"));
        }
    })
}

/// The `NT_GNU_BUILD_ID` note of a little-endian ELF64 file read by `read(offset, len)`,
/// as hex: reads the header, the program headers and the notes only.
fn elf_build_id(read: impl Fn(u64, usize) -> Option<Vec<u8>>) -> Option<String> {
    let le = |b: &[u8]| b.iter().rev().fold(0u64, |acc, &x| (acc << 8) | u64::from(x));
    let head = read(0, 64)?;
    if head.get(..4)? != b"\x7fELF" || head[4] != 2 || head[5] != 1 {
        return None;
    }
    let (phoff, phentsize, phnum) = (le(&head[0x20..0x28]), le(&head[0x36..0x38]), le(&head[0x38..0x3a]));
    let phs = read(phoff, usize::try_from(phentsize.checked_mul(phnum)?).ok()?)?;
    for ph in phs.chunks_exact(usize::try_from(phentsize).ok()?.max(56)) {
        if le(&ph[0..4]) != 4 {
            continue; // not PT_NOTE
        }
        let (offset, size) = (le(&ph[8..16]), usize::try_from(le(&ph[32..40])).ok()?);
        let notes = read(offset, size.min(1 << 16))?;
        let mut at = 0usize;
        while at + 12 <= notes.len() {
            let (namesz, descsz, kind) =
                (le(&notes[at..at + 4]), le(&notes[at + 4..at + 8]), le(&notes[at + 8..at + 12]));
            let (namesz, descsz) = (usize::try_from(namesz).ok()?, usize::try_from(descsz).ok()?);
            let name = at + 12;
            let desc = name.checked_add(round_up(namesz, 4))?;
            if kind == 3 && notes.get(name..name + namesz)? == b"GNU\0" {
                let id = notes.get(desc..desc.checked_add(descsz)?)?;
                return Some(id.iter().map(|b| format!("{b:02x}")).collect());
            }
            at = desc.checked_add(round_up(descsz, 4))?;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_id_of_this_test_binary_is_found_when_it_has_one() {
        fn reader(bytes: &[u8]) -> impl Fn(u64, usize) -> Option<Vec<u8>> + '_ {
            |o, l| {
                let o = usize::try_from(o).ok()?;
                bytes.get(o..o.checked_add(l)?).map(<[u8]>::to_vec)
            }
        }
        let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        if let Some(id) = elf_build_id(reader(&exe)) {
            assert!(id.len() >= 16 && id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
        let junk = b"not an elf file, not at all, not even close to sixty-four bytes long....".to_vec();
        assert!(elf_build_id(reader(&junk)).is_none());
        assert_eq!(cpu_identity().len(), 32);
    }
}
