//! Workers' reports of how they obtained each model's weights (`WorkerReport`), kept per
//! connection (the latest per engine and model, bounded), and what the host shares and
//! saves per model. Reports are attributed to their connection's peer credentials and only
//! ever displayed and counted: nothing is decided on them.

use std::collections::HashMap;
use std::time::SystemTime;

use packd_proto::v1::{Fallback, Obtained};

use super::{ClientId, Inner, SegmentId, Store};

/// Bytes kept of a report's engine and model names.
pub const REPORT_NAME_BYTES: usize = 128;
/// Bytes kept of a report's detail.
pub const REPORT_DETAIL_BYTES: usize = 256;

/// One report, as kept.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// The engine or integration (untrusted text).
    pub engine: String,
    /// The model (cache identity, segment key or a display name; untrusted text).
    pub model: String,
    /// How its weights were obtained.
    pub obtained: Obtained,
    /// Why privately (for `Obtained::Private`).
    pub fallback: Fallback,
    /// The worker's own words (untrusted text).
    pub detail: String,
    /// Bytes held privately.
    pub private_bytes: u64,
    /// Bytes mapped from packd.
    pub shared_bytes: u64,
    /// When it arrived.
    pub at: SystemTime,
}

impl Report {
    /// Whether this report says the weights are held privately.
    pub fn is_private(&self) -> bool {
        self.obtained == Obtained::Private
    }
}

/// What became of a report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kept {
    /// Kept (replacing the connection's earlier report of the same engine and model).
    Yes,
    /// Not kept: the connection has reports of as many models as the limit allows (it is
    /// still counted).
    OverLimit,
    /// The connection is gone.
    NoConnection,
}

/// The stable lowercase name of a fallback reason (the metrics' `reason` label).
pub fn fallback_name(f: Fallback) -> &'static str {
    match f {
        Fallback::Unspecified | Fallback::Other => "other",
        Fallback::DaemonAway => "daemon_away",
        Fallback::UnknownInterface => "unknown_interface",
        Fallback::UnnamedWeights => "unnamed_weights",
        Fallback::OverQuota => "over_quota",
        Fallback::BuildTimeout => "build_timeout",
        Fallback::BuilderGaveUp => "builder_gave_up",
        Fallback::BuildLimit => "build_limit",
        Fallback::PublishRefused => "publish_refused",
        Fallback::EngineCache => "engine_cache",
        Fallback::Asked => "asked",
        Fallback::WorkerError => "worker_error",
        Fallback::BuildSlow => "build_slow",
        Fallback::UnsharedBufferType => "unshared_buffer_type",
    }
}

/// Every reason a fallback is counted under, in a stable order.
pub const FALLBACKS: [Fallback; 14] = [
    Fallback::Other,
    Fallback::DaemonAway,
    Fallback::UnknownInterface,
    Fallback::UnnamedWeights,
    Fallback::OverQuota,
    Fallback::BuildTimeout,
    Fallback::BuilderGaveUp,
    Fallback::BuildLimit,
    Fallback::PublishRefused,
    Fallback::EngineCache,
    Fallback::Asked,
    Fallback::WorkerError,
    Fallback::BuildSlow,
    Fallback::UnsharedBufferType,
];

/// Counters of reports since start-up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReportCounters {
    /// Reports received.
    pub received: u64,
    /// Reports not kept at the per-connection limit.
    pub dropped: u64,
    /// Private fallbacks by reason, indexed as [`FALLBACKS`].
    pub fallbacks: [u64; FALLBACKS.len()],
}

impl ReportCounters {
    fn slot(f: Fallback) -> usize {
        // Unspecified is counted as other (slot 0).
        FALLBACKS.iter().position(|&x| x == f).unwrap_or(0)
    }

    /// Private fallbacks reported for `f`.
    pub fn fallbacks_of(&self, f: Fallback) -> u64 {
        self.fallbacks[Self::slot(f)]
    }

    /// `(reason name, count)` for every reason, zeros included.
    pub fn by_reason(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        FALLBACKS.iter().map(|&f| (fallback_name(f), self.fallbacks_of(f)))
    }
}

/// What the host shares and saves, and how its connected workers got their weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sharing {
    /// Each segment's size times the connections holding a lease on it.
    pub bytes_mapped: u64,
    /// `bytes_mapped` minus the size of every segment mapped at all.
    pub bytes_saved: u64,
    /// Connections holding a lease.
    pub workers_served: u64,
    /// Connections holding a builder role.
    pub workers_building: u64,
    /// Connections whose latest report of some model says private.
    pub workers_private: u64,
    /// Bytes connected workers report holding privately.
    pub private_bytes: u64,
}

/// One model: the segments of one cache identity or one source, and the reports naming it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelInfo {
    /// Cache identity, source digest (`b3:<hex>`), or a name only reports give.
    pub model: String,
    /// Display label (untrusted text).
    pub label: String,
    /// Segments in the index.
    pub segments: u64,
    /// Their bytes as charged to the budget.
    pub bytes_resident: u64,
    /// Requests served from its segments.
    pub hits: u64,
    /// What its segments share and save, and its workers (served: holding a lease on one of
    /// its segments; building: a builder role for it; private: their latest report of it).
    pub sharing: Sharing,
}

impl ModelInfo {
    /// Adds `other`'s figures to this one's (for models summed as one).
    pub fn add(&mut self, other: &ModelInfo) {
        self.segments += other.segments;
        self.bytes_resident += other.bytes_resident;
        self.hits += other.hits;
        let (s, o) = (&mut self.sharing, &other.sharing);
        s.bytes_mapped += o.bytes_mapped;
        s.bytes_saved += o.bytes_saved;
        s.workers_served += o.workers_served;
        s.workers_building += o.workers_building;
        s.workers_private += o.workers_private;
        s.private_bytes += o.private_bytes;
    }
}

impl Inner {
    /// Segment size by id, zombies included.
    fn size_of(&self, id: SegmentId) -> u64 {
        self.segments.get(&id).map(|r| r.seg.size).or_else(|| self.zombies.get(&id).map(|s| s.size)).unwrap_or(0)
    }

    /// O(segments held + connections): holders are counted as leases come and go.
    pub(super) fn sharing(&self) -> Sharing {
        let mut s = Sharing::default();
        for (&id, &n) in &self.holders {
            let size = self.size_of(id);
            s.bytes_mapped += n * size;
            s.bytes_saved += n.saturating_sub(1) * size;
        }
        for (&id, c) in &self.clients {
            s.workers_served += u64::from(!c.leases.is_empty());
            s.workers_building += u64::from(self.builds.count_of(id) > 0);
            let mut private = false;
            for r in c.reports.iter().filter(|r| r.is_private()) {
                private = true;
                s.private_bytes += r.private_bytes;
            }
            s.workers_private += u64::from(private);
        }
        s
    }
}

/// Models being gathered: each once, found by name.
#[derive(Default)]
struct Gather {
    models: Vec<ModelInfo>,
    by_name: HashMap<String, usize>,
}

impl Gather {
    /// The model named `name` (made with `label` when new).
    fn model(&mut self, name: &str, label: impl FnOnce() -> String) -> usize {
        if let Some(&i) = self.by_name.get(name) {
            return i;
        }
        self.models.push(ModelInfo { model: name.to_string(), label: label(), ..Default::default() });
        self.by_name.insert(name.to_string(), self.models.len() - 1);
        self.models.len() - 1
    }
}

impl Store {
    /// Keeps `report` as `client`'s latest about its engine and model, and counts it.
    pub fn report(&self, client: ClientId, report: Report) -> Kept {
        let mut inner = self.lock();
        let limit = inner.quotas.reports_per_connection;
        inner.reports.received += 1;
        let Some(c) = inner.clients.get_mut(&client) else { return Kept::NoConnection };
        let earlier = c.reports.iter().position(|r| r.engine == report.engine && r.model == report.model);
        // A fallback is counted unless the report repeats the connection's latest one of the
        // same engine and model (with its bytes, or resent): that is not a second fallback.
        let new_fallback = report.is_private()
            && earlier.is_none_or(|i| !c.reports[i].is_private() || c.reports[i].fallback != report.fallback);
        let slot = ReportCounters::slot(report.fallback);
        let kept = match earlier {
            Some(i) => {
                c.reports.remove(i);
                c.reports.push(report);
                Kept::Yes
            }
            None if c.reports.len() >= limit => Kept::OverLimit,
            None => {
                c.reports.push(report);
                Kept::Yes
            }
        };
        if kept == Kept::OverLimit {
            inner.reports.dropped += 1;
        }
        if new_fallback {
            inner.reports.fallbacks[slot] += 1;
        }
        kept
    }

    /// The report counters.
    pub fn report_counters(&self) -> ReportCounters {
        self.lock().reports
    }

    /// What the host shares and saves now.
    pub fn sharing(&self) -> Sharing {
        self.lock().sharing()
    }

    /// Every model, by bytes resident (largest first), then by name. One pass over the
    /// segments, the holders and the connections' leases and reports.
    pub fn models(&self) -> Vec<ModelInfo> {
        self.models_seen_by(|_| true, |_| true)
    }

    /// [`Store::models`] as a caller sees them: only the segments `segment_visible`
    /// admits, and only the reports, leases and builder roles of the uids `uid_visible`
    /// admits (a non-admin does not learn what another uid's workers run or publish).
    /// Holders of a visible segment are counted whoever they are.
    pub fn models_seen_by(
        &self,
        segment_visible: impl Fn(&super::Segment) -> bool,
        uid_visible: impl Fn(u32) -> bool,
    ) -> Vec<ModelInfo> {
        let inner = self.lock();
        let mut g = Gather::default();
        let mut by_segment: HashMap<SegmentId, usize> = HashMap::with_capacity(inner.segments.len());
        let mut hex = String::new();
        for (&id, r) in inner.segments.iter().filter(|(_, r)| segment_visible(&r.seg)) {
            let name = match &r.seg.publisher {
                Some(p) => p.identity.as_str(),
                None => {
                    hex.clear();
                    hex.push_str("b3:");
                    hex.push_str(&r.seg.source.hex());
                    hex.as_str()
                }
            };
            let label = || {
                if r.seg.label.is_empty() {
                    r.seg.publisher.as_ref().map(|p| p.identity.clone()).unwrap_or_default()
                } else {
                    r.seg.label.clone()
                }
            };
            let i = g.model(name, label);
            let m = &mut g.models[i];
            m.segments += 1;
            m.bytes_resident += r.seg.charged;
            m.hits += r.hits;
            by_segment.insert(id, i);
        }
        for (&id, &n) in &inner.holders {
            let (Some(&i), Some(r)) = (by_segment.get(&id), inner.segments.get(&id)) else { continue };
            let s = &mut g.models[i].sharing;
            s.bytes_mapped += n * r.seg.size;
            s.bytes_saved += n.saturating_sub(1) * r.seg.size;
        }
        let mut seen: Vec<usize> = Vec::new();
        for c in inner.clients.values().filter(|c| uid_visible(c.peer.uid)) {
            seen.clear();
            seen.extend(c.leases.keys().filter_map(|id| by_segment.get(id).copied()));
            seen.sort_unstable();
            seen.dedup();
            for &i in &seen {
                g.models[i].sharing.workers_served += 1;
            }
            seen.clear();
            for r in c.reports.iter().filter(|r| r.is_private()) {
                // A report naming a segment key counts under that segment's model.
                let segment = crate::key::SegmentKey::parse(&r.model)
                    .and_then(|k| inner.by_key.get(&k))
                    .and_then(|id| by_segment.get(id).copied());
                let i = match segment {
                    Some(i) => i,
                    None => g.model(&r.model, || r.model.clone()),
                };
                g.models[i].sharing.private_bytes += r.private_bytes;
                if !seen.contains(&i) {
                    g.models[i].sharing.workers_private += 1;
                    seen.push(i);
                }
            }
        }
        for b in inner.builds.iter().filter(|b| uid_visible(b.uid)) {
            let i = g.model(&b.identity, || b.identity.clone());
            g.models[i].sharing.workers_building += 1;
        }
        let mut out = g.models;
        out.sort_by(|a, b| b.bytes_resident.cmp(&a.bytes_resident).then_with(|| a.model.cmp(&b.model)));
        out
    }
}
