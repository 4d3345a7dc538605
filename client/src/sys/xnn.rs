//! A host-wide weights cache for XNNPACK (`struct xnn_weights_cache_provider`), backed by
//! packd's engine-published segments.
//!
//! Created for a *cache identity* (the model, the XNNPACK build, the CPU features and the
//! provider's own key format), it asks packd for the identity's published segment:
//!
//! * **served**: the segment is mapped read-only and every `look_up` XNNPACK makes is
//!   answered from its table, with no daemon round trip; XNNPACK packs nothing.
//! * **building**: this process is the identity's builder. Packed weights XNNPACK can name
//!   go into a memfd mapped writable; [`XnnCache::finalize`] (after the runtime is created)
//!   replaces that mapping with a read-only one at the same address (XNNPACK keeps its
//!   pointers), seals the memfd and publishes it.
//! * **private**: packd is away, another process's build overran, or the caller asked for
//!   it: everything is packed into private memory, counted, nothing published.
//!
//! Keys. XNNPACK's look-up key is a seed and the *addresses* of the kernel and bias. An
//! address is named by the packd entry it lies in (any model mapped through this library,
//! see [`crate::names`]) or by a range the engine named ([`XnnCache::name_range`]); a key
//! with an address nobody named is never looked up or published: its weights are packed
//! privately and counted as `unnamed`. A name must stand for the whole parameter set of
//! the operator (XNNPACK gives no bias address for qd8 nodes, and never the scales).
//!
//! Memory. Everything handed to XNNPACK lies in one address-space reservation: the shared
//! area (the published or building segment) first, then a private area. An offset is an
//! address minus the reservation's base, so `offset_to_addr` needs no lock and nothing ever
//! moves. `reserve_space` memory is 64-byte aligned (XNNPACK's packers use aligned stores).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;

use crate::sys::vm::{self, Reservation};
use crate::{AcquireOptions, Acquired, Client, Error, PublishEntry, Segment};

/// Address space reserved for the shared area and again for the private area.
const AREA: usize = 64 << 30;
/// Growth step of the building memfd and of the private area's backing.
const STEP: usize = 4 << 20;
/// Alignment of every `reserve_space` block.
const ALIGN: usize = 64;
/// XNNPACK's "not found" offset.
pub const NOT_FOUND: usize = usize::MAX;
/// Version of the provider's key format (part of the identity).
const KEY_FORMAT: u32 = 1;

/// What the cache does for this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub enum XnnMode {
    /// Looks weights up in a segment another process published.
    Served = 0,
    /// Builds the segment and publishes it at [`XnnCache::finalize`].
    Building = 1,
    /// Published the segment it built.
    Published = 2,
    /// Packs privately (see [`XnnStats::reason`]).
    Private = 3,
}

/// Counters an engine (and an operator) can read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XnnStats {
    /// `look_up` calls answered with an offset.
    pub hits: u64,
    /// `look_up` calls answered "not found".
    pub misses: u64,
    /// `reserve_space` calls (each one is a weight XNNPACK packs in this process).
    pub reserve_space: u64,
    /// Bytes XNNPACK packed in this process (sum of `reserve_space` sizes).
    pub bytes_packed: u64,
    /// Bytes of packed weights this process holds privately (not shared).
    pub bytes_private: u64,
    /// Bytes of the shared segment this process maps.
    pub bytes_shared: u64,
    /// Weights whose key had an address nobody named (packed privately).
    pub unnamed: u64,
    /// Inserts whose name was known with other bytes (kept privately, never served).
    pub conflicts: u64,
    /// Inserts answered with an existing copy (same name or same bytes).
    pub deduplicated: u64,
    /// The mode.
    pub mode: Option<XnnMode>,
    /// Why the weights are private, when they are.
    pub reason: String,
}

/// Where a block handed out by `reserve_space` lies.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Area {
    Shared,
    Private,
}

struct Reserved {
    area: Area,
    offset: usize,
    len: usize,
}

/// The shared area's state.
enum Shared {
    /// A published segment, mapped read-only at offset 0; its table by name.
    Served { segment: Segment, table: HashMap<String, (usize, usize)> },
    /// The memfd being built: `cursor` bytes used, `backed` bytes sized and mapped.
    Building { file: File, cursor: usize, backed: usize, entries: Vec<PublishEntry> },
    /// The published (or, if publishing failed, privately kept) build, read-only, `size`
    /// bytes mapped.
    Done { segment: Option<Segment>, _file: File, size: usize },
    /// None.
    Nothing,
}

struct State {
    shared: Shared,
    mode: XnnMode,
    reason: String,
    private_cursor: usize,
    private_backed: usize,
    /// Named weights inserted in this process: name → (offset, length).
    inserted: HashMap<String, (usize, usize)>,
    /// Unnamed private weights by content, for deduplication.
    by_bytes: HashMap<[u8; 32], (usize, usize)>,
    /// Each thread's last look-up (its name, if any), for the `reserve_space` that follows.
    pending: HashMap<ThreadId, Option<String>>,
    /// Ranges the engine named: start → (end, name).
    named: BTreeMap<usize, (usize, String)>,
    /// The block `reserve_space` handed out and `look_up_or_insert` has not taken yet.
    reserved: Option<Reserved>,
}

/// The provider's state (see the module documentation).
pub struct XnnCache {
    client: Client,
    identity: String,
    res: Reservation,
    state: Mutex<State>,
    /// Held from `reserve_space` to `look_up_or_insert`, as XNNPACK's own cache does.
    slot: Mutex<bool>,
    freed: Condvar,
    /// The publication running in the background since `finalize`.
    publishing: Mutex<Option<std::thread::JoinHandle<Result<Segment, Error>>>>,
    hits: AtomicU64,
    misses: AtomicU64,
    reserve_calls: AtomicU64,
    bytes_packed: AtomicU64,
    unnamed: AtomicU64,
    conflicts: AtomicU64,
    deduplicated: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// The cache identity of `model` packed by the XNNPACK build `engine` on this CPU: at most
/// 256 printable ASCII characters.
pub fn identity(model: &str, engine: &str, cpu: &str) -> String {
    let short = |s: &str| {
        if s.len() <= 80 && s.bytes().all(|b| (0x21..0x7f).contains(&b) && b != b';') {
            s.to_string()
        } else {
            format!("b3:{}", &blake3::hash(s.as_bytes()).to_hex()[..32])
        }
    };
    format!(
        "xnnpack;key=v{KEY_FORMAT}/{}b;model={};engine={};cpu={}",
        std::mem::size_of::<usize>() * 8,
        short(model),
        short(engine),
        short(cpu)
    )
}

impl XnnCache {
    /// A cache for `identity` (see [`identity`]): acquires the identity from packd and
    /// serves, builds or packs privately accordingly. With `private`, packd is not asked.
    /// Never fails because of packd: a daemon that is away makes the cache private.
    pub fn new(client: Client, identity: String, options: AcquireOptions, private: bool) -> Result<Self, Error> {
        let res = Reservation::new(2 * AREA)?;
        let cache = Self {
            client,
            identity,
            res,
            state: Mutex::new(State {
                shared: Shared::Nothing,
                mode: XnnMode::Private,
                reason: String::new(),
                private_cursor: 0,
                private_backed: 0,
                inserted: HashMap::new(),
                by_bytes: HashMap::new(),
                pending: HashMap::new(),
                named: BTreeMap::new(),
                reserved: None,
            }),
            slot: Mutex::new(false),
            freed: Condvar::new(),
            publishing: Mutex::new(None),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            reserve_calls: AtomicU64::new(0),
            bytes_packed: AtomicU64::new(0),
            unnamed: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
            deduplicated: AtomicU64::new(0),
        };
        let (shared, mode, reason) = if private {
            (Shared::Nothing, XnnMode::Private, "private mode was asked for".to_string())
        } else {
            match cache.client.acquire(&cache.identity, options) {
                Ok(Acquired::Segment(seg)) => cache.serve(seg)?,
                Ok(Acquired::Build { .. }) => {
                    let file = vm::memfd("packd-xnnpack")?;
                    let shared = Shared::Building { file, cursor: 0, backed: 0, entries: Vec::new() };
                    (shared, XnnMode::Building, String::new())
                }
                Ok(Acquired::Private { reason }) => (Shared::Nothing, XnnMode::Private, reason),
                Err(e) => (Shared::Nothing, XnnMode::Private, format!("packd: {e}")),
            }
        };
        {
            let mut st = lock(&cache.state);
            st.shared = shared;
            st.mode = mode;
            st.reason = reason;
        }
        Ok(cache)
    }

    /// Maps a published segment read-only at the start of the reservation.
    fn serve(&self, seg: Segment) -> Result<(Shared, XnnMode, String), Error> {
        let size = usize::try_from(seg.info().size).map_err(|_| Error::Protocol("segment too large".into()))?;
        if size > AREA {
            return Ok((Shared::Nothing, XnnMode::Private, format!("the published segment is over {AREA} bytes")));
        }
        self.res.map_file(0, size, seg.file(), 0, false)?;
        let mut table = HashMap::new();
        for e in &seg.info().entries {
            let at = (usize::try_from(e.offset), usize::try_from(e.length));
            if let (Ok(offset), Ok(length)) = at {
                table.insert(e.name.clone(), (offset, length));
            }
        }
        Ok((Shared::Served { segment: seg, table }, XnnMode::Served, String::new()))
    }

    /// The cache identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Names `[ptr, ptr + len)`: a kernel or bias address inside it is named `name` (with
    /// `+OFFSET` past its start). The name must stand for the weights' bytes *and* every
    /// other parameter XNNPACK packs with them (bias, scales), since those may not be in
    /// XNNPACK's key.
    pub fn name_range(&self, ptr: usize, len: usize, name: &str) {
        if len > 0 {
            lock(&self.state).named.insert(ptr, (ptr.saturating_add(len), name.to_string()));
        }
    }

    fn name_of(&self, st: &State, addr: usize) -> Option<String> {
        if let Some((start, (end, name))) = st.named.range(..=addr).next_back()
            && addr < *end
        {
            return Some(if addr == *start { name.clone() } else { format!("{name}+{}", addr - start) });
        }
        crate::names::entry_at(addr)
    }

    /// The provider's name of a look-up key, `None` when an address is not named.
    fn key_name(&self, st: &State, seed: u32, kernel: usize, bias: usize) -> Option<String> {
        if kernel == 0 {
            return None;
        }
        let k = self.name_of(st, kernel)?;
        let b = if bias == 0 { "-".to_string() } else { self.name_of(st, bias)? };
        Some(format!("s={seed:08x};k={k};b={b}"))
    }

    /// XNNPACK's `look_up`.
    pub fn look_up(&self, seed: u32, kernel: usize, bias: usize) -> usize {
        let mut st = lock(&self.state);
        let name = self.key_name(&st, seed, kernel, bias);
        st.pending.insert(std::thread::current().id(), name.clone());
        let found = name.as_ref().and_then(|n| match &st.shared {
            Shared::Served { table, .. } => table.get(n).map(|&(o, _)| o),
            _ => None,
        });
        let found = found.or_else(|| name.as_ref().and_then(|n| st.inserted.get(n).map(|&(o, _)| o)));
        drop(st);
        match found {
            Some(offset) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                offset
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                NOT_FOUND
            }
        }
    }

    /// XNNPACK's `reserve_space`: 64-byte-aligned memory that never moves; NULL (0) when
    /// none can be had. Holds the cache's insert slot until `look_up_or_insert`.
    pub fn reserve_space(&self, n: usize) -> usize {
        let mut busy = lock(&self.slot);
        while *busy {
            busy = self.freed.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        *busy = true;
        drop(busy);
        let got = self.reserve(n.max(1));
        if got.is_none() {
            self.free_slot();
        }
        got.map_or(0, |offset| self.res.base() + offset)
    }

    fn free_slot(&self) {
        *lock(&self.slot) = false;
        // Readers wait on the slot too, and take no turn: wake everyone to look again.
        self.freed.notify_all();
    }

    fn reserve(&self, n: usize) -> Option<usize> {
        let mut st = lock(&self.state);
        let named = st.pending.remove(&std::thread::current().id()).flatten();
        let len = round_up(n, ALIGN);
        self.reserve_calls.fetch_add(1, Ordering::Relaxed);
        self.bytes_packed.fetch_add(len as u64, Ordering::Relaxed);
        let into_shared = named.is_some() && matches!(st.shared, Shared::Building { .. });
        let offset = if into_shared {
            let Shared::Building { file, cursor, backed, .. } = &mut st.shared else { return None };
            let start = round_up(*cursor, ALIGN);
            let end = start.checked_add(len).filter(|&e| e <= AREA)?;
            if end > *backed {
                let grown = round_up(end, STEP).min(AREA);
                file.set_len(grown as u64).ok()?;
                self.res.map_file(*backed, grown - *backed, file, *backed as u64, true).ok()?;
                *backed = grown;
            }
            *cursor = end;
            st.reserved = Some(Reserved { area: Area::Shared, offset: start, len });
            start
        } else {
            let start = round_up(st.private_cursor, ALIGN);
            let end = start.checked_add(len).filter(|&e| e <= AREA)?;
            if end > st.private_backed {
                let grown = round_up(end, STEP).min(AREA);
                self.res.commit(AREA + st.private_backed, grown - st.private_backed).ok()?;
                st.private_backed = grown;
            }
            st.private_cursor = end;
            st.reserved = Some(Reserved { area: Area::Private, offset: AREA + start, len });
            AREA + start
        };
        Some(offset)
    }

    /// XNNPACK's `look_up_or_insert`: files the block at `ptr` (from `reserve_space`) under
    /// the key's name, or answers with an identical copy already held. Returns its offset.
    pub fn look_up_or_insert(&self, seed: u32, kernel: usize, bias: usize, ptr: usize, size: usize) -> usize {
        let offset = self.insert(seed, kernel, bias, ptr, size);
        self.free_slot();
        offset
    }

    fn insert(&self, seed: u32, kernel: usize, bias: usize, ptr: usize, size: usize) -> usize {
        let mut st = lock(&self.state);
        let Some(offset) = ptr.checked_sub(self.res.base()).filter(|&o| o < self.res.len()) else {
            return NOT_FOUND;
        };
        let reserved = st.reserved.take();
        let area = if offset < AREA { Area::Shared } else { Area::Private };
        let name = self.key_name(&st, seed, kernel, bias);
        // SAFETY: XNNPACK filled `size` bytes at `ptr`, a block `reserve_space` handed out
        // (backed memory in the reservation); it does not write them any more.
        let bytes = unsafe { self.res.bytes(offset, size) };
        let same = |o: usize, l: usize| {
            // SAFETY: `o`, `l` is an entry filed earlier (shared or private, backed) whose
            // bytes are complete and no longer written.
            l == size && unsafe { self.res.bytes(o, l) } == bytes
        };
        let unused = |st: &mut State| {
            // The block is not needed: give it back if it is the last one handed out.
            if let Some(r) = &reserved
                && r.offset == offset
            {
                match r.area {
                    Area::Private if st.private_cursor + AREA == r.offset + r.len => st.private_cursor -= r.len,
                    Area::Shared => {
                        if let Shared::Building { cursor, .. } = &mut st.shared
                            && *cursor == r.offset + r.len
                        {
                            *cursor -= r.len;
                        }
                    }
                    Area::Private => {}
                }
            }
        };
        let Some(name) = name else {
            self.unnamed.fetch_add(1, Ordering::Relaxed);
            let digest = *blake3::hash(bytes).as_bytes();
            if let Some(&(o, l)) = st.by_bytes.get(&digest)
                && same(o, l)
            {
                self.deduplicated.fetch_add(1, Ordering::Relaxed);
                unused(&mut st);
                return o;
            }
            st.by_bytes.insert(digest, (offset, size));
            return offset;
        };
        let known = match &st.shared {
            Shared::Served { table, .. } => table.get(&name).copied(),
            _ => None,
        }
        .or_else(|| st.inserted.get(&name).copied());
        if let Some((o, l)) = known {
            if same(o, l) {
                self.deduplicated.fetch_add(1, Ordering::Relaxed);
                unused(&mut st);
                return o;
            }
            // The name does not stand for these bytes: keep them (in the building memfd they
            // stay unlisted), never file or publish them under the name.
            self.conflicts.fetch_add(1, Ordering::Relaxed);
            return offset;
        }
        st.inserted.insert(name.clone(), (offset, size));
        if area == Area::Shared
            && let Shared::Building { entries, .. } = &mut st.shared
        {
            entries.push(PublishEntry { key: name, offset: offset as u64, length: size as u64 });
        }
        offset
    }

    /// XNNPACK's `offset_to_addr`.
    pub fn offset_to_addr(&self, offset: usize) -> usize {
        if offset < self.res.len() { self.res.base() + offset } else { 0 }
    }

    /// A copy of the `len` bytes at `offset` (an offset `look_up` or `look_up_or_insert`
    /// returned), for checking what the cache holds. Waits while another thread fills a
    /// `reserve_space` block (until its `look_up_or_insert`), and keeps new blocks from
    /// being reserved while it copies. `None` when the range is not memory the cache holds.
    pub fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        let mut busy = lock(&self.slot);
        while *busy {
            busy = self.freed.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        let st = lock(&self.state);
        if st.reserved.is_some() {
            return None;
        }
        let shared = match &st.shared {
            Shared::Served { segment, .. } => usize::try_from(segment.info().size).ok()?,
            Shared::Building { backed, .. } => *backed,
            Shared::Done { size, .. } => *size,
            Shared::Nothing => 0,
        };
        let end = offset.checked_add(len)?;
        if !(end <= shared || (offset >= AREA && end <= AREA + st.private_backed)) {
            return None;
        }
        // SAFETY: the range is backed (the shared area's mapped part, or the private area's
        // committed part, checked above), and with no reserved block outstanding, held
        // under the state lock that `reserve_space` takes, nothing writes any of it.
        Some(unsafe { self.res.bytes(offset, len) }.to_vec())
    }

    /// Publishes what this process built (in `Building` mode; otherwise nothing to do).
    /// Call it after `xnn_create_runtime*` returned and before the runtime is set up on
    /// other threads. The built weights stay where they are, read-only from now on; the
    /// publication itself (packd hashes every entry) runs on a thread of its own, so the
    /// engine need not wait for it ([`XnnCache::wait_published`] does). A publication packd
    /// refuses (already published by another process, over a limit) leaves them private;
    /// the reason is in [`XnnCache::stats`].
    pub fn finalize(&self) -> Result<(), Error> {
        let busy = lock(&self.slot);
        let mut st = lock(&self.state);
        let Shared::Building { .. } = &st.shared else { return Ok(()) };
        let Shared::Building { file, cursor, backed, entries } = std::mem::replace(&mut st.shared, Shared::Nothing)
        else {
            return Ok(());
        };
        let page = vm::page();
        let size = round_up(cursor.max(1), page);
        // Read-only at the same addresses (XNNPACK keeps pointers), the rest given back, then
        // sealed: no writable mapping is left, so F_SEAL_WRITE can be set.
        let remapped = (|| -> std::io::Result<()> {
            if backed > size {
                self.res.decommit(size, backed - size)?;
            }
            file.set_len(size as u64)?;
            // A shared mapping through a writable fd counts as writable for F_SEAL_WRITE even
            // when it is read-only (it could be mprotect'ed): map through a read-only fd of
            // the same memfd. Without /proc, unmap, seal, and map again at the same address.
            match vm::reopen_read_only(&file) {
                Ok(ro) => {
                    self.res.map_file(0, size, &ro, 0, false)?;
                    vm::seal(&file)
                }
                Err(_) => {
                    self.res.decommit(0, size)?;
                    vm::seal(&file)?;
                    self.res.map_file(0, size, &file, 0, false)
                }
            }
        })();
        let outcome = match remapped {
            Err(e) => Err(format!("sealing the built segment failed: {e}")),
            Ok(()) if entries.is_empty() => Err("no weight could be named: nothing to publish".into()),
            Ok(()) => Ok(()),
        };
        match outcome {
            Err(reason) => {
                st.mode = XnnMode::Private;
                st.reason = reason;
            }
            Ok(()) => {
                // The weights are ready (sealed, read-only, in place): the engine goes on while
                // packd checks and hashes the publication on a thread of its own.
                let (client, identity, size) = (self.client.clone(), self.identity.clone(), size as u64);
                let publish = move |file: File| client.publish(&identity, &file, size, &entries);
                let handle = match file.try_clone() {
                    Ok(dup) => std::thread::Builder::new()
                        .name("packd-xnn-publish".into())
                        .spawn(move || publish(dup))
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                match handle {
                    Ok(handle) => *lock(&self.publishing) = Some(handle),
                    Err(e) => {
                        st.mode = XnnMode::Private;
                        st.reason = format!("cannot start publishing: {e}");
                    }
                }
            }
        }
        st.shared = Shared::Done { segment: None, _file: file, size };
        drop(st);
        drop(busy);
        Ok(())
    }

    /// Waits for the publication [`XnnCache::finalize`] started (if any) and records its
    /// outcome: `Published`, or `Private` with the reason packd refused it.
    pub fn wait_published(&self) {
        let Some(handle) = lock(&self.publishing).take() else { return };
        let result = handle.join().unwrap_or_else(|_| Err(Error::Protocol("the publishing thread panicked".into())));
        let mut st = lock(&self.state);
        match result {
            Ok(seg) => {
                if let Shared::Done { segment, .. } = &mut st.shared {
                    *segment = Some(seg);
                }
                st.mode = XnnMode::Published;
            }
            Err(e) => {
                st.mode = XnnMode::Private;
                st.reason = format!("publishing failed: {e}");
            }
        }
    }

    /// The counters.
    pub fn stats(&self) -> XnnStats {
        if lock(&self.publishing).as_ref().is_some_and(std::thread::JoinHandle::is_finished) {
            self.wait_published();
        }
        let st = lock(&self.state);
        let shared_bytes = match &st.shared {
            Shared::Served { segment, .. } => segment.info().size,
            _ => 0,
        };
        let published = match &st.shared {
            Shared::Done { segment: Some(seg), .. } => seg.info().size,
            _ => 0,
        };
        let built_private = match (&st.shared, st.mode) {
            (Shared::Building { cursor, .. }, _) => *cursor as u64,
            (Shared::Done { segment: None, .. }, XnnMode::Private) => {
                st.inserted.values().filter(|(o, _)| *o < AREA).map(|(_, l)| *l as u64).sum()
            }
            _ => 0,
        };
        XnnStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            reserve_space: self.reserve_calls.load(Ordering::Relaxed),
            bytes_packed: self.bytes_packed.load(Ordering::Relaxed),
            bytes_private: st.private_cursor as u64 + built_private,
            bytes_shared: shared_bytes + published,
            unnamed: self.unnamed.load(Ordering::Relaxed),
            conflicts: self.conflicts.load(Ordering::Relaxed),
            deduplicated: self.deduplicated.load(Ordering::Relaxed),
            mode: Some(st.mode),
            reason: st.reason.clone(),
        }
    }
}

impl Drop for XnnCache {
    fn drop(&mut self) {
        // A publication under way finishes (or fails) before the weights are unmapped.
        self.wait_published();
    }
}

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

/// The build of the engine whose code lies at `addr`: the GNU build-id of the ELF file
/// mapped there, or (without one) the BLAKE3 of that file. `None` if no file maps `addr`.
pub fn engine_identity(addr: usize) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let path = maps.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        let (lo, hi) = parts.next()?.split_once('-')?;
        let (lo, hi) = (usize::from_str_radix(lo, 16).ok()?, usize::from_str_radix(hi, 16).ok()?);
        let path = parts.nth(4)?;
        (addr >= lo && addr < hi && path.starts_with('/')).then(|| path.to_string())
    })?;
    let file = File::open(&path).ok()?;
    let name = std::path::Path::new(&path).file_name()?.to_string_lossy().into_owned();
    let read = |offset: u64, len: usize| {
        let mut buf = vec![0u8; len];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, offset).ok().map(|()| buf)
    };
    Some(match elf_build_id(read) {
        Some(id) => format!("{name}@id:{id}"),
        None => format!("{name}@b3:{}", &blake3::hash(&std::fs::read(&path).ok()?).to_hex()[..32]),
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
    fn identities_are_bounded_printable_and_change_with_every_part() {
        let a = identity("b3:abc", "libXNNPACK.so@id:12", "cpu1");
        assert!(a.len() <= 256 && a.bytes().all(|b| (0x20..0x7f).contains(&b)), "{a}");
        assert_ne!(a, identity("b3:abd", "libXNNPACK.so@id:12", "cpu1"));
        assert_ne!(a, identity("b3:abc", "libXNNPACK.so@id:13", "cpu1"));
        assert_ne!(a, identity("b3:abc", "libXNNPACK.so@id:12", "cpu2"));
        let long = identity(&"m".repeat(1000), "e;x", "c");
        assert!(long.len() <= 256, "{long}");
    }

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
