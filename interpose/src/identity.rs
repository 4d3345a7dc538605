//! What identifies the code an engine runs: the CPU it dispatches on and the build of the
//! library that holds a function (its GNU build-id, else a digest of the file).

#![forbid(unsafe_code)]

use std::fs::File;

/// A digest of what engines dispatch their kernels on: the CPU's vendor, family, model and feature
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
pub fn library_at(addr: usize) -> Option<String> {
    crate::maps::at(addr).map(|m| m.path).filter(|p| p.starts_with('/'))
}

/// The build of the library whose code lies at `addr`: its file name and GNU build-id
/// (`name@id:HEX`), or without one the BLAKE3 of the file (`name@b3:HEX`). `None` if no file
/// maps `addr`.
pub fn library_build(addr: usize) -> Option<String> {
    file_build(&library_at(addr)?)
}

/// [`library_build`] of the ELF file at `path`.
pub fn file_build(path: &str) -> Option<String> {
    let file = File::open(path).ok()?;
    let name = std::path::Path::new(path).file_name()?.to_string_lossy().into_owned();
    let read = |offset: u64, len: usize| {
        let mut buf = vec![0u8; len];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, offset).ok().map(|()| buf)
    };
    Some(match elf_build_id(read) {
        Some(id) => format!("{name}@id:{id}"),
        None => format!("{name}@b3:{}", &blake3::hash(&std::fs::read(path).ok()?).to_hex()[..32]),
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
            let desc = name.checked_add(namesz.next_multiple_of(4))?;
            if kind == 3 && notes.get(name..name + namesz)? == b"GNU\0" {
                let id = notes.get(desc..desc.checked_add(descsz)?)?;
                return Some(id.iter().map(|b| format!("{b:02x}")).collect());
            }
            at = desc.checked_add(descsz.next_multiple_of(4))?;
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
