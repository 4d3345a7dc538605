//! The objects loaded in this process and their imports, read from their dynamic sections,
//! and the one write this crate makes into them: replacing a symbol's GOT slot (a
//! `JUMP_SLOT` or `GLOB_DAT` relocation's target), as plthook does. Only for ELF64
//! with RELA relocations (x86_64, aarch64): on other targets nothing is found.

// ELF64's u64 fields are addresses and sizes of this 64-bit process: they fit usize.
#![allow(clippy::cast_possible_truncation)]

use std::ffi::{CStr, c_int, c_void};
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A loaded object (the program, a library) as the dynamic linker lists it.
#[derive(Clone, Debug)]
pub struct Object {
    /// Its load bias.
    pub base: usize,
    /// Its path (empty for the program itself, as the dynamic linker reports it).
    pub name: String,
    /// Its `PT_LOAD` ranges, absolute.
    pub loads: Vec<(usize, usize)>,
    /// Its dynamic section's address.
    dynamic: Option<usize>,
}

impl Object {
    /// Whether `addr` lies in one of its loaded segments.
    pub fn contains(&self, addr: usize) -> bool {
        self.loads.iter().any(|&(lo, hi)| addr >= lo && addr < hi)
    }
}

/// A slot of an object's GOT that the dynamic linker filled with a symbol's address.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Import {
    /// The symbol's name.
    symbol: String,
    /// The slot's address.
    slot: usize,
}

/// Every object loaded now.
pub fn objects() -> Vec<Object> {
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
        // SAFETY: `data` is the `&mut Vec<Object>` passed to dl_iterate_phdr below, alive for
        // the call and used by nobody else meanwhile.
        let out = unsafe { &mut *data.cast::<Vec<Object>>() };
        // SAFETY: the dynamic linker passes a valid entry for the duration of the callback.
        let info = unsafe { &*info };
        let base = info.dlpi_addr as usize;
        let name = if info.dlpi_name.is_null() {
            String::new()
        } else {
            // SAFETY: a NUL-terminated string the linker owns, valid during the callback.
            unsafe { CStr::from_ptr(info.dlpi_name) }.to_string_lossy().into_owned()
        };
        let phdrs: &[libc::Elf64_Phdr] = if info.dlpi_phdr.is_null() {
            &[]
        } else {
            // SAFETY: `dlpi_phnum` program headers at `dlpi_phdr`, mapped with the object.
            unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) }
        };
        let mut obj = Object { base, name, loads: Vec::new(), dynamic: None };
        for ph in phdrs {
            let (at, len) = (base.wrapping_add(ph.p_vaddr as usize), ph.p_memsz as usize);
            match ph.p_type {
                libc::PT_LOAD => obj.loads.push((at, at.saturating_add(len))),
                libc::PT_DYNAMIC => obj.dynamic = Some(at),
                _ => {}
            }
        }
        out.push(obj);
        0
    }
    let mut out: Vec<Object> = Vec::new();
    if !cfg!(target_pointer_width = "64") {
        return out;
    }
    // SAFETY: the callback only reads what the linker passes and pushes onto `out`, which
    // outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), (&raw mut out).cast()) };
    out
}

const DT_NULL: i64 = 0;
const DT_PLTRELSZ: i64 = 2;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_RELA: i64 = 7;
const DT_RELASZ: i64 = 8;
const DT_RELAENT: i64 = 9;
const DT_STRSZ: i64 = 10;
const DT_PLTREL: i64 = 20;
const DT_JMPREL: i64 = 23;

#[cfg(target_arch = "x86_64")]
const SLOT_TYPES: [u32; 2] = [6, 7]; // R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT
#[cfg(target_arch = "aarch64")]
const SLOT_TYPES: [u32; 2] = [1025, 1026]; // R_AARCH64_GLOB_DAT, R_AARCH64_JUMP_SLOT
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const SLOT_TYPES: [u32; 0] = [];

/// The GOT slots of `obj` bound to a symbol `wanted` accepts. Reads the object's dynamic
/// section and relocation tables in memory (the dynamic linker's own copies).
fn imports(obj: &Object, wanted: impl Fn(&str) -> bool) -> Vec<Import> {
    let Some(dynamic) = obj.dynamic else { return Vec::new() };
    if !cfg!(target_pointer_width = "64") || SLOT_TYPES.is_empty() {
        return Vec::new();
    }
    // The linker relocates most d_ptr values in place; the vDSO's (and some others') stay
    // relative to the base.
    let abs = |v: u64| -> usize {
        let v = v as usize;
        if v < obj.base { v.wrapping_add(obj.base) } else { v }
    };
    let (mut strtab, mut strsz, mut symtab) = (0usize, 0usize, 0usize);
    let (mut jmprel, mut pltrelsz, mut pltrel) = (0usize, 0usize, DT_RELA as u64);
    let (mut rela, mut relasz, mut relaent) = (0usize, 0usize, 24usize);
    for i in 0.. {
        // SAFETY: the dynamic section is an array of (tag, value) pairs ending with DT_NULL,
        // mapped with the object (`PT_DYNAMIC`); read until that end.
        let (tag, val) = unsafe {
            let at = (dynamic as *const u64).add(2 * i);
            (at.read() as i64, at.add(1).read())
        };
        match tag {
            DT_NULL => break,
            DT_STRTAB => strtab = abs(val),
            DT_STRSZ => strsz = val as usize,
            DT_SYMTAB => symtab = abs(val),
            DT_JMPREL => jmprel = abs(val),
            DT_PLTRELSZ => pltrelsz = val as usize,
            DT_PLTREL => pltrel = val,
            DT_RELA => rela = abs(val),
            DT_RELASZ => relasz = val as usize,
            DT_RELAENT => relaent = val as usize,
            _ => {}
        }
    }
    if strtab == 0 || symtab == 0 || relaent != 24 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut table = |start: usize, bytes: usize| {
        if start == 0 {
            return;
        }
        for k in 0..bytes / 24 {
            // SAFETY: a RELA table of `bytes` bytes (its DT_*SZ), mapped with the object:
            // (offset, info, addend) triples of u64.
            let (offset, info) = unsafe {
                let at = (start as *const u64).add(3 * k);
                (at.read(), at.add(1).read())
            };
            let (kind, sym) = ((info & 0xffff_ffff) as u32, (info >> 32) as usize);
            if sym == 0 || !SLOT_TYPES.contains(&kind) {
                continue;
            }
            // SAFETY: `sym` indexes the dynamic symbol table the relocation refers to; an
            // Elf64_Sym is 24 bytes and starts with its name's offset in the string table.
            let name_off = unsafe { (symtab as *const u8).add(24 * sym).cast::<u32>().read_unaligned() } as usize;
            if name_off >= strsz {
                continue;
            }
            // SAFETY: a NUL-terminated name inside the string table (offset checked against
            // DT_STRSZ; the table ends with a NUL).
            let name = unsafe { CStr::from_ptr((strtab as *const std::ffi::c_char).add(name_off)) };
            let Ok(name) = name.to_str() else { continue };
            if wanted(name) {
                out.push(Import { symbol: name.to_string(), slot: obj.base.wrapping_add(offset as usize) });
            }
        }
    };
    if pltrel == DT_RELA as u64 {
        table(jmprel, pltrelsz);
    }
    table(rela, relasz);
    out
}

/// The address a slot holds now.
fn read_slot(import: &Import) -> usize {
    // SAFETY: a GOT slot of a loaded object (found by `imports`): pointer-sized, aligned,
    // readable; other threads may write it only through `write_slot` (atomically).
    unsafe { AtomicUsize::from_ptr(import.slot as *mut usize) }.load(Ordering::Acquire)
}

/// Points the slot at `value`; returns what it held. A slot on a read-only page (RELRO) is
/// made writable for the write, and the page gets its protection back after it.
///
/// # Safety
/// `value` must be a function with the exact signature of the symbol the slot is bound to
/// (every call the object makes through the slot will go there), and the object the slot
/// belongs to must stay loaded during the call.
unsafe fn write_slot(import: &Import, value: usize) -> io::Result<usize> {
    let page = crate::sys::vm::page();
    let start = import.slot / page * page;
    // The page's protection now, to put back exactly: a RELRO page is read-only after
    // relocation (RELRO's last page may share a page with writable data, and stays so).
    let before = protection(start).ok_or_else(|| io::Error::other("the slot's page is not in /proc/self/maps"))?;
    let writable = before & libc::PROT_WRITE != 0;
    if !writable {
        // SAFETY: one page of the object's relocated data, made writable for a moment; it
        // holds pointers and data, nothing executes from it (it keeps its other bits).
        if unsafe { libc::mprotect(start as *mut c_void, page, before | libc::PROT_WRITE) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    // SAFETY: a pointer-sized, aligned slot of a loaded object, writable now; the store is
    // atomic, so a thread calling through it sees the old or the new function, both valid.
    let old = unsafe { AtomicUsize::from_ptr(import.slot as *mut usize) }.swap(value, Ordering::AcqRel);
    if !writable {
        // SAFETY: the same page back to the protection it had.
        unsafe { libc::mprotect(start as *mut c_void, page, before) };
    }
    Ok(old)
}

/// The protection of the page at `addr`, from `/proc/self/maps`.
fn protection(addr: usize) -> Option<c_int> {
    let m = super::maps::at(addr)?;
    let perms = m.perms.as_bytes();
    let bit = |i: usize, c: u8, p: c_int| if perms.get(i) == Some(&c) { p } else { libc::PROT_NONE };
    Some(bit(0, b'r', libc::PROT_READ) | bit(1, b'w', libc::PROT_WRITE) | bit(2, b'x', libc::PROT_EXEC))
}

/// A function an adapter takes over: its symbol, the hook's address, and the address of
/// the engine's own definition (0: the engine has none, and its slots stay as they are).
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    symbol: &'static str,
    hook: usize,
    real: usize,
}

impl Slot {
    /// # Safety
    /// `hook` must be a function with the exact signature of the symbol `symbol` (every
    /// call through a slot bound to it will go there), and stay loaded while any slot
    /// points at it.
    pub unsafe fn new(symbol: &'static str, hook: usize, real: usize) -> Self {
        Self { symbol, hook, real }
    }

    pub fn symbol(&self) -> &'static str {
        self.symbol
    }
}

/// A loaded object held open by handle (`dlopen` with `RTLD_NOLOAD`), so that it stays
/// loaded while its slots are read and written.
pub struct Pinned {
    pub object: Object,
    handle: crate::sys::Loaded,
}

impl Pinned {
    /// Pins `object` (the program, or a library by its path); `None` when it cannot be
    /// pinned (unloaded meanwhile).
    pub fn pin(object: &Object) -> Option<Self> {
        let handle = if object.name.is_empty() {
            crate::sys::Loaded::program()
        } else {
            crate::sys::Loaded::open(&object.name)
        }?;
        Some(Self { object: object.clone(), handle })
    }

    /// The library's handle (the program's global scope for the program itself).
    pub fn handle(&self) -> &crate::sys::Loaded {
        &self.handle
    }

    /// The address of `name` when this object defines it (the symbol lies in its segments).
    pub fn defines(&self, name: &CStr) -> Option<usize> {
        let at = self.handle.symbol(name)?.as_ptr() as usize;
        self.object.contains(at).then_some(at)
    }

    /// Its path, or "the program" (whose name the dynamic linker leaves empty).
    pub fn display_name(&self) -> String {
        if self.object.name.is_empty() { "the program".to_string() } else { self.object.name.clone() }
    }
}

/// Points the pinned object's slots for `slots`' symbols at their hooks: a slot bound to
/// the engine's own function, or not bound yet (pointing into its object's PLT); a slot
/// bound to another library's definition is left alone. Returns how many slots now go
/// through a hook.
pub fn hook_object(pinned: &Pinned, slots: &[Slot]) -> usize {
    let obj = &pinned.object;
    let mut hooked = 0;
    for import in imports(obj, |name| slots.iter().any(|s| s.symbol == name)) {
        let Some(s) = slots.iter().find(|s| s.symbol == import.symbol) else { continue };
        let now = read_slot(&import);
        if now == s.hook {
            hooked += 1;
            continue;
        }
        if s.real == 0 || (now != s.real && !obj.contains(now)) {
            continue;
        }
        // SAFETY: `hook` has the exact signature of the symbol the slot is bound to (the
        // contract of `Slot::new`), and the object is loaded (`pinned` holds it).
        if unsafe { write_slot(&import, s.hook) }.is_ok() {
            hooked += 1;
        }
    }
    hooked
}
