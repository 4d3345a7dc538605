//! This process's mappings, from `/proc/self/maps`: the one parser the provider (which
//! library holds a function), the adoption (which file a tensor's bytes come from) and the
//! GOT writer (a page's protection) share.

#![forbid(unsafe_code)]

/// One line of `/proc/self/maps`.
#[derive(Clone, Debug)]
pub struct Mapping {
    pub lo: usize,
    pub hi: usize,
    /// `rwxp`-style permissions.
    pub perms: String,
    /// Offset in the file mapped.
    pub offset: u64,
    /// Device (major, minor) and inode of the file (0: anonymous).
    pub dev: (u64, u64),
    pub inode: u64,
    /// The path, or a pseudo name (`[heap]`), or empty.
    pub path: String,
}

impl Mapping {
    pub fn contains(&self, addr: usize) -> bool {
        addr >= self.lo && addr < self.hi
    }
}

/// Every mapping, in address order (empty when `/proc` cannot be read).
pub(crate) fn read() -> Vec<Mapping> {
    let Ok(text) = std::fs::read_to_string("/proc/self/maps") else { return Vec::new() };
    text.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (lo, hi) = f.next()?.split_once('-')?;
            let perms = f.next()?.to_string();
            let offset = u64::from_str_radix(f.next()?, 16).ok()?;
            let (maj, min) = f.next()?.split_once(':')?;
            let inode: u64 = f.next()?.parse().ok()?;
            Some(Mapping {
                lo: usize::from_str_radix(lo, 16).ok()?,
                hi: usize::from_str_radix(hi, 16).ok()?,
                perms,
                offset,
                dev: (u64::from_str_radix(maj, 16).ok()?, u64::from_str_radix(min, 16).ok()?),
                inode,
                path: f.collect::<Vec<_>>().join(" "),
            })
        })
        .collect()
}

/// Every mapping of this process, in address order (empty when `/proc` cannot be read).
pub fn all() -> Vec<Mapping> {
    read()
}

/// The mapping holding `addr`.
pub fn at(addr: usize) -> Option<Mapping> {
    read().into_iter().find(|m| m.contains(addr))
}

/// Every mapping of `file` (the same device and inode) in this process, in address order:
/// where an engine mapped a file packd gave it. Empty when `file` cannot be stat'ed.
pub fn of_file(file: &std::fs::File) -> Vec<Mapping> {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = file.metadata() else { return Vec::new() };
    let dev = (nix::sys::stat::major(md.dev()), nix::sys::stat::minor(md.dev()));
    read().into_iter().filter(|m| m.inode == md.ino() && m.dev == dev).collect()
}
