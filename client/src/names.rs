//! Which packd entry an address points into: every mapped [`crate::Model`] registers its
//! mapping here for as long as it lives, so an engine's weights cache can name a weight by
//! its entry key rather than by its address (which means nothing in another process).
//!
//! One registration per model (its address range and its entry table), so mapping and
//! unmapping a model costs one map insertion; naming an address searches that model's
//! entries.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::proto;

struct Region {
    end: usize,
    info: Arc<proto::SegmentReply>,
}

static REGIONS: Mutex<BTreeMap<usize, Region>> = Mutex::new(BTreeMap::new());

fn regions() -> MutexGuard<'static, BTreeMap<usize, Region>> {
    REGIONS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records that `[start, start + len)` maps the segment `info` describes.
pub(crate) fn register(start: usize, len: usize, info: &Arc<proto::SegmentReply>) {
    if len > 0 {
        regions().insert(start, Region { end: start.saturating_add(len), info: Arc::clone(info) });
    }
}

/// Forgets the mapping at `start` (it is being unmapped).
pub(crate) fn unregister(start: usize) {
    regions().remove(&start);
}

/// The entry key of the packd entry holding `addr`, with `+OFFSET` when `addr` is not its
/// first byte; `None` when no mapped model's entry holds it.
pub fn entry_at(addr: usize) -> Option<String> {
    let regions = regions();
    let (start, region) = regions.range(..=addr).next_back()?;
    if addr >= region.end {
        return None;
    }
    let at = (addr - start) as u64;
    let e = region.info.entries.iter().find(|e| at >= e.offset && at - e.offset < e.length)?;
    Some(if at == e.offset { e.key.clone() } else { format!("{}+{}", e.key, at - e.offset) })
}
