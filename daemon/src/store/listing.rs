//! Read-only views of the store for the control plane.

use std::time::SystemTime;

use super::lease::Peer;
use super::{ClientId, Store};

/// A consistent snapshot of the store's figures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    /// Entries across all segments in the index.
    pub entries: u64,
    /// Segments in the index.
    pub segments: u64,
    /// Leases held (sum of refcounts).
    pub leases: u64,
    /// Connected clients.
    pub clients: u64,
    /// Pack jobs started.
    pub pack_jobs: u64,
    /// Pack jobs that failed.
    pub pack_failures: u64,
    /// Seconds spent in successful pack jobs.
    pub pack_seconds: f64,
    /// Requests served by an existing or in-flight segment.
    pub hits: u64,
    /// Requests that started a pack job.
    pub misses: u64,
    /// Requests answered with an error.
    pub request_errors: u64,
    /// Bytes of all segments in the index.
    pub bytes_resident: u64,
    /// The byte budget for segments in the index.
    pub budget_bytes: u64,
    /// Bytes reserved by running pack jobs and publications (lends apart).
    pub reserved_bytes: u64,
    /// Lends taken back for room before a builder claimed them.
    pub lends_revoked: u64,
    /// Bytes of evicted segments still leased by clients.
    pub zombie_bytes: u64,
    /// Bytes of the spare memfd ready for the next pack job (counted against the budget,
    /// as is one being made, and dropped first when segments need the room).
    pub spare_bytes: u64,
    /// Pack jobs that wrote into the spare instead of allocating fresh memory.
    pub spare_takes: u64,
    /// Segments evicted (by the budget or by request).
    pub evictions: u64,
    /// Seconds since the store was created.
    pub uptime_seconds: f64,
    /// Published segments in the index.
    pub published_segments: u64,
    /// Bytes of published segments in the index.
    pub published_bytes: u64,
    /// Builder roles handed out.
    pub builds: u64,
    /// Acquires that waited for another connection's build.
    pub build_waits: u64,
    /// Builder roles ended by their connection closing.
    pub builds_abandoned: u64,
    /// Builder roles ended by their deadline.
    pub builds_expired: u64,
    /// Builder roles given up by their builder, with nothing to publish.
    pub builds_given_up: u64,
    /// Waits ended because building privately was faster.
    pub build_waits_slow: u64,
    /// Workers that reported their engine packs privately.
    pub private_reports: u64,
    /// Builder roles held now.
    pub builds_active: u64,
    /// Acquires refused a builder role at a limit on roles held.
    pub builds_refused: u64,
    /// Publications accepted.
    pub publishes: u64,
    /// Publications refused.
    pub publishes_refused: u64,
    pub publishes_withdrawn: u64,
    /// Aliases filed to published segments ([`Store::alias`](super::Store::alias)).
    pub aliases_filed: u64,
    /// Pack jobs whose segment was in the index already when they finished.
    pub duplicates_dropped: u64,
    /// What the host shares and saves now.
    pub sharing: super::Sharing,
    /// Worker reports since start-up.
    pub reports: super::ReportCounters,
}

/// One entry in the index.
#[derive(Clone, Debug, PartialEq)]
pub struct EntryInfo {
    /// Entry key.
    pub key: String,
    /// Key of the segment holding it.
    pub segment_key: String,
    /// Tensor name.
    pub name: String,
    /// Canonical layout.
    pub layout: String,
    /// Packed bytes of the entry.
    pub bytes: u64,
    /// Leases on its segment.
    pub refcount: u64,
    /// Whether its segment is pinned.
    pub pinned: bool,
    /// Requests served from its segment.
    pub hits: u64,
    /// Last time its segment was served.
    pub last_access: SystemTime,
    /// When its segment was packed.
    pub packed_at: SystemTime,
    /// How long the segment's pack job took.
    pub pack_ms: f64,
    /// BLAKE3 of the packed bytes, hex.
    pub blake3: String,
    /// Who published its segment (`None`: packd packed it).
    pub publisher: Option<super::Publisher>,
    /// Its segment's display label (empty: none).
    pub label: String,
    /// Its segment's size: the memfd's length (entries 64-byte aligned, page-rounded).
    pub segment_bytes: u64,
    /// What its segment counts against the budget: the size plus the index's metadata for
    /// it, in whole pages (the segment's share of `bytes_resident`).
    pub resident_bytes: u64,
}

/// One connected client.
#[derive(Clone, Debug, PartialEq)]
pub struct ClientInfo {
    /// Connection id.
    pub id: ClientId,
    /// Peer credentials.
    pub peer: Peer,
    /// When it connected.
    pub connected_at: SystemTime,
    /// Leases it holds.
    pub leases: u64,
    /// Bytes of the segments it holds leases on (each segment once).
    pub bytes_mapped: u64,
    /// Builder roles it holds.
    pub builds: u64,
    /// Its latest report per engine and model, oldest first.
    pub reports: Vec<super::Report>,
}

impl Store {
    /// A consistent snapshot of the figures.
    pub fn stats(&self) -> Stats {
        let inner = self.lock();
        let c = inner.counters;
        let published = inner.segments.values().filter(|r| r.seg.publisher.is_some());
        Stats {
            entries: inner.segments.values().map(|r| r.seg.entries.len() as u64).sum(),
            segments: inner.segments.len() as u64,
            leases: inner.refcounts.values().sum(),
            clients: inner.clients.len() as u64,
            pack_jobs: c.pack_jobs,
            pack_failures: c.pack_failures,
            pack_seconds: c.pack_seconds,
            hits: c.hits,
            misses: c.misses,
            request_errors: c.request_errors,
            bytes_resident: inner.resident_bytes(),
            budget_bytes: inner.budget,
            reserved_bytes: inner.reserved.saturating_sub(inner.lent.bytes),
            lends_revoked: inner.lent.revocations,
            zombie_bytes: inner.zombies.values().map(|s| s.charged).sum(),
            spare_bytes: inner.spare.ready_bytes(),
            spare_takes: inner.spare.takes,
            evictions: c.evictions,
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            published_segments: published.clone().count() as u64,
            published_bytes: published.map(|r| r.seg.size).sum(),
            builds: c.builds,
            build_waits: c.build_waits,
            builds_abandoned: c.builds_abandoned,
            builds_expired: c.builds_expired,
            builds_given_up: c.builds_given_up,
            build_waits_slow: c.build_waits_slow,
            private_reports: inner.reports.fallbacks.iter().sum(),
            builds_active: inner.builds.len() as u64,
            builds_refused: c.builds_refused,
            publishes: c.publishes,
            publishes_refused: c.publishes_refused,
            publishes_withdrawn: c.publishes_withdrawn,
            aliases_filed: c.aliases_filed,
            duplicates_dropped: c.duplicates_dropped,
            sharing: inner.sharing(),
            reports: inner.reports,
        }
    }

    /// Every entry whose key starts with `prefix` (all when empty), sorted by key.
    pub fn list_entries(&self, prefix: &str) -> Vec<EntryInfo> {
        let inner = self.lock();
        let mut out: Vec<EntryInfo> = inner
            .segments
            .iter()
            .flat_map(|(id, r)| {
                let refcount = inner.refcounts.get(id).copied().unwrap_or(0);
                // An entry matches by its own key or its segment's (as evict and pin select).
                let whole = r.seg.key.starts_with(prefix);
                r.seg.entries.iter().filter(move |e| whole || e.key.starts_with(prefix)).map(move |e| EntryInfo {
                    key: e.key.to_string(),
                    segment_key: r.seg.key.to_string(),
                    name: e.name.clone(),
                    layout: e.layout.to_string(),
                    bytes: e.length,
                    refcount,
                    pinned: r.pinned,
                    hits: r.hits,
                    last_access: r.last_access,
                    packed_at: r.packed_at,
                    pack_ms: r.pack_ms,
                    blake3: blake3::Hash::from_bytes(e.blake3).to_hex().to_string(),
                    publisher: r.seg.publisher.clone(),
                    label: r.seg.label.clone(),
                    segment_bytes: r.seg.size,
                    resident_bytes: r.seg.charged,
                })
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    /// Every connected client, by connection id.
    pub fn list_clients(&self) -> Vec<ClientInfo> {
        let inner = self.lock();
        let size = |id: &u64| {
            inner.segments.get(id).map(|r| r.seg.size).or_else(|| inner.zombies.get(id).map(|s| s.size)).unwrap_or(0)
        };
        let mut out: Vec<ClientInfo> = inner
            .clients
            .iter()
            .map(|(id, c)| ClientInfo {
                id: *id,
                peer: c.peer,
                connected_at: c.connected_at,
                leases: c.leases.values().sum(),
                bytes_mapped: c.leases.keys().map(size).sum(),
                builds: inner.builds.count_of(*id),
                reports: c.reports.clone(),
            })
            .collect();
        out.sort_by_key(|c| c.id);
        out
    }
}
