//! This process's mappings, from `/proc/self/maps`: the one parser the provider (which
//! library holds a function), the adoption (which file a tensor's bytes come from) and the
//! GOT writer (a page's protection) share. Looked up by address ([`Lookup`]), the kernel is
//! asked for the one mapping (`PROCMAP_QUERY`, Linux 6.11) instead of printing them all: a
//! process with PyTorch loaded has thousands, and reading them costs about a millisecond.

use std::fs::File;
use std::os::fd::AsRawFd;

/// One line of `/proc/self/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    Lookup::new().at(addr)
}

/// Mappings looked up one address at a time, each as it is when asked: by the kernel's
/// `PROCMAP_QUERY` where it has it, else from one read of the whole list (kept for the
/// next look-ups). Past [`Lookup::QUERIES`] queries the whole list is read too: a query
/// cost 0.7 µs and a read of 3 000 mappings 0.4 ms here, so many look-ups cost less from
/// the list.
pub struct Lookup {
    /// `/proc/self/maps`, while the kernel answers queries on it.
    maps: Option<File>,
    /// Queries left before the whole list is read instead.
    queries: usize,
    /// The whole list, read once the kernel did not answer (or after many queries).
    read: Option<Vec<Mapping>>,
}

impl Default for Lookup {
    fn default() -> Self {
        Self::new()
    }
}

impl Lookup {
    /// Queries asked of the kernel at most, before the whole list is read.
    pub const QUERIES: usize = 512;

    pub fn new() -> Self {
        Self { maps: File::open("/proc/self/maps").ok(), queries: Self::QUERIES, read: None }
    }

    /// A look-up from the whole list only (as on a kernel before 6.11).
    pub fn from_list() -> Self {
        Self { maps: None, queries: 0, read: None }
    }

    /// The mapping holding `addr`, `None` when nothing is mapped there.
    pub fn at(&mut self, addr: usize) -> Option<Mapping> {
        if self.queries == 0 {
            self.maps = None;
        }
        if let Some(maps) = &self.maps {
            self.queries -= 1;
            match query(maps, addr) {
                Ok(found) => return found,
                Err(_) => self.maps = None,
            }
        }
        let all = self.read.get_or_insert_with(read);
        let i = all.partition_point(|m| m.lo <= addr).checked_sub(1)?;
        all.get(i).filter(|m| m.contains(addr)).cloned()
    }
}

/// `struct procmap_query` of `linux/fs.h`.
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: u32 = 0xc068_6611;
const _: () = assert!(std::mem::size_of::<ProcmapQuery>() == 0x68);

/// The mapping holding `addr` as the kernel answers `PROCMAP_QUERY` on `maps` (`Ok(None)`:
/// none); `Err` when the kernel cannot answer (before 6.11: `ENOTTY`; a path longer than
/// the buffer).
fn query(maps: &File, addr: usize) -> std::io::Result<Option<Mapping>> {
    const NAME: u32 = libc::PATH_MAX as u32;
    let mut name = vec![0u8; NAME as usize];
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_addr: addr as u64,
        vma_name_size: NAME,
        vma_name_addr: name.as_mut_ptr() as u64,
        ..ProcmapQuery::default()
    };
    // SAFETY: `q` is a `struct procmap_query` of the size it says; the kernel writes at most
    // `vma_name_size` bytes to `name`, which is that long and outlives the call.
    if unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY as _, &raw mut q) } != 0 {
        let e = std::io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENOENT) { Ok(None) } else { Err(e) };
    }
    // The size written counts the terminating NUL (0: no name).
    name.truncate((q.vma_name_size as usize).saturating_sub(1));
    let flag = |bit: u64, c: char| if q.vma_flags & bit != 0 { c } else { '-' };
    let perms = [flag(1, 'r'), flag(2, 'w'), flag(4, 'x'), if q.vma_flags & 8 != 0 { 's' } else { 'p' }];
    let address = |a: u64| usize::try_from(a).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidData));
    Ok(Some(Mapping {
        lo: address(q.vma_start)?,
        hi: address(q.vma_end)?,
        perms: perms.iter().collect(),
        offset: q.vma_offset,
        dev: (u64::from(q.dev_major), u64::from(q.dev_minor)),
        inode: q.inode,
        path: String::from_utf8_lossy(&name).into_owned(),
    }))
}

/// Every mapping of `file` (the same device and inode) in this process, in address order:
/// where an engine mapped a file packd gave it. Empty when `file` cannot be stat'ed.
pub fn of_file(file: &std::fs::File) -> Vec<Mapping> {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = file.metadata() else { return Vec::new() };
    let dev = (nix::sys::stat::major(md.dev()), nix::sys::stat::minor(md.dev()));
    read().into_iter().filter(|m| m.inode == md.ino() && m.dev == dev).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether this kernel has `PROCMAP_QUERY` (Linux 6.11).
    fn kernel_queries() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut v = release.trim().split(|c: char| !c.is_ascii_digit()).map(|x| x.parse::<u32>().unwrap_or(0));
        (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= (6, 11)
    }

    #[test]
    fn a_query_answers_as_the_whole_list_reads() {
        // A file mapped read-only, shared, at an offset; a page of it made executable.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mapped file");
        std::fs::write(&path, vec![7u8; 4 * crate::sys::page()]).unwrap();
        let file = File::open(&path).unwrap();
        let res = crate::sys::Reservation::new(8 * crate::sys::page()).unwrap();
        let page = crate::sys::page();
        // SAFETY: a fresh reservation: nothing refers into it.
        unsafe { res.map_file(page, 2 * page, &file, page as u64) }.unwrap();
        let heap = vec![1u8; 64 << 20];
        let local = 5u64;
        let addrs = [
            res.base() + page,
            res.base() + 2 * page + 17,
            res.base() + 3 * page, // past the file's mapping: the reservation itself
            a_query_answers_as_the_whole_list_reads as *const () as usize,
            heap.as_ptr() as usize + (32 << 20),
            &raw const local as usize,
            0x1000, // nothing
        ];
        let mut queried = Lookup::new();
        let mut listed = Lookup::from_list();
        let mut answered = 0;
        for &a in &addrs {
            let q = queried.at(a);
            assert_eq!(q, listed.at(a), "at {a:#x}");
            answered += usize::from(q.is_some());
        }
        assert_eq!(answered, addrs.len() - 1);
        let m = queried.at(res.base() + page).unwrap();
        assert_eq!(
            (m.lo, m.hi, m.offset, m.perms.as_str()),
            (res.base() + page, res.base() + 3 * page, page as u64, "r--s")
        );
        assert_eq!(m.path, path.to_str().unwrap());
        assert_eq!(m.inode, std::os::unix::fs::MetadataExt::ino(&file.metadata().unwrap()));
        // The kernel answered (not the list read after a refusal) where it can.
        assert_eq!(queried.maps.is_some(), kernel_queries());
        assert!(listed.maps.is_none() && listed.read.is_some());
        // Past the bound of queries, the same answers from the list, read once.
        for _ in 0..Lookup::QUERIES {
            queried.at(res.base() + page);
        }
        assert!(queried.read.is_some() && queried.maps.is_none());
        for &a in &addrs {
            assert_eq!(queried.at(a), listed.at(a), "at {a:#x}, from the list");
        }
    }
}
