//! The scan every adapter runs to take an engine's calls over: the objects loaded since the
//! last scan are pinned (held open by handle, so none is unloaded while its slots are
//! written), the adapter looks at them to find its engine, and the slots through which
//! they call the functions the adapter hooks are pointed at its hooks.
//!
//! A slot is written only when it is bound to the engine's own function, or not bound yet
//! (still pointing into its object's PLT); a slot bound to another library's definition is
//! left alone. The adapter's own object, the dynamic linker and libc are never hooked.

#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::sync::Mutex;

use crate::sys::Object;
pub use crate::sys::{Pinned, Slot, hook_object};

/// What a scan asks of an adapter.
pub trait Adapter {
    /// An address inside the adapter's own object (never hooked).
    fn own_address(&self) -> usize;

    /// Looks at the objects loaded since the last scan (to find the engine among them) and
    /// returns the slots to hook in them; none while the adapter does not act.
    fn found(&self, fresh: &[Pinned]) -> Vec<Slot>;
}

/// The objects already scanned, by (base, path): a library unloaded and loaded again is
/// scanned again once a scan has seen it gone. One scan at a time.
pub struct Scanner {
    seen: Mutex<BTreeSet<(usize, String)>>,
}

impl Scanner {
    pub const fn new() -> Self {
        Self { seen: Mutex::new(BTreeSet::new()) }
    }

    /// Scans the objects loaded since the last scan for `adapter`; returns the names of
    /// those with a slot now going through a hook. The dynamic linker is called with no
    /// lock of the adapter's held, so a hook running meanwhile never waits for the loader.
    pub fn scan(&self, adapter: &dyn Adapter) -> Vec<String> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let all = crate::sys::objects();
        // A handle on each object: it waits for a load in progress to finish, and keeps the
        // object loaded while its slots are rewritten. One that cannot be pinned is left alone.
        let fresh: Vec<Pinned> =
            all.iter().filter(|o| !seen.contains(&(o.base, o.name.clone()))).filter_map(Pinned::pin).collect();
        let slots = adapter.found(&fresh);
        let me = adapter.own_address();
        let mut hooked = Vec::new();
        if !slots.is_empty() {
            for p in &fresh {
                if !p.object.contains(me) && !is_loader(&p.object) && hook_object(p, &slots) > 0 {
                    hooked.push(p.display_name());
                }
            }
        }
        let present: BTreeSet<(usize, String)> = all.iter().map(|o| (o.base, o.name.clone())).collect();
        seen.retain(|k| present.contains(k));
        seen.extend(fresh.iter().map(|p| (p.object.base, p.object.name.clone())));
        hooked
    }
}

impl Scanner {
    /// Forgets every object scanned: the next scan looks at all of them again (for an
    /// adapter that found its engine only once a later object came, so that the slots of
    /// those scanned before are hooked too; hooking a slot twice changes nothing).
    pub fn forget(&self) {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

impl Default for Scanner {
    fn default() -> Self {
        Self::new()
    }
}

/// The dynamic linker, libc and the vDSO: never hooked (their own calls do not go through
/// these slots, and a slot of theirs must stay as the system made it).
pub fn is_loader(obj: &Object) -> bool {
    let file = obj.name.rsplit('/').next().unwrap_or_default();
    file.starts_with("ld-linux") || file.starts_with("libc.so") || file.starts_with("linux-vdso")
}
