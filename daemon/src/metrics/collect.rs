//! The metrics read from the store at each scrape.

use std::fmt::Error;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

use crate::control::ControlPlane;
use crate::store::{ModelInfo, Stats};

/// Bytes of a model's name or label kept in a label value.
const LABEL_BYTES: usize = 128;

/// Everything one scrape shows, taken at once.
#[derive(Debug)]
pub struct Snapshot {
    /// The store's figures.
    pub stats: Stats,
    /// Models, by bytes resident.
    pub models: Vec<ModelInfo>,
    /// Connections shed and refused at the admission limits.
    pub shed: u64,
    /// Connections refused.
    pub refused: u64,
    /// Control-plane connections open, and refused at their limits.
    pub control: (u64, u64),
    /// Log lines left out.
    pub suppressed: u64,
    /// Sources hashed.
    pub source_hashes: u64,
    /// Lent bytes not yet published, and builder roles that came with lent memory.
    pub lends: crate::store::LendStats,
}

impl Snapshot {
    /// Takes the snapshot.
    pub fn take(plane: &ControlPlane) -> Self {
        let store = &plane.packer.store;
        Self {
            stats: store.stats(),
            models: store.models(),
            shed: plane.admission.shed_count(),
            refused: plane.admission.refused_count(),
            control: (plane.connections.open() as u64, plane.connections.refused_count()),
            suppressed: plane.request_log.suppressed(),
            source_hashes: plane.packer.digests.computed(),
            lends: plane.packer.lends.stats(),
        }
    }
}

/// A label value from untrusted text: escaped as the text format requires (prometheus-client
/// writes label values as given), at most [`LABEL_BYTES`] bytes.
pub fn label_value(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(LABEL_BYTES) + 8);
    for c in text.chars() {
        if out.len() + c.len_utf8() > LABEL_BYTES {
            break;
        }
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

pub(super) struct StoreCollector {
    pub(super) plane: Arc<ControlPlane>,
    pub(super) max_models: usize,
}

impl std::fmt::Debug for StoreCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreCollector").field("max_models", &self.max_models).finish_non_exhaustive()
    }
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, unit: Option<&Unit>, v: u64) -> Result<(), Error> {
    let g = ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX));
    g.encode(e.encode_descriptor(name, help, unit, g.metric_type())?)
}

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, unit: Option<&Unit>, v: u64) -> Result<(), Error> {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, unit, c.metric_type())?)
}

/// One gauge family: `rows` of (labels, value).
fn gauges<L: prometheus_client::encoding::EncodeLabelSet>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    rows: &[(L, u64)],
) -> Result<(), Error> {
    let mut m = e.encode_descriptor(name, help, unit, MetricType::Gauge)?;
    for (labels, v) in rows {
        ConstGauge::new(i64::try_from(*v).unwrap_or(i64::MAX)).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// Models past the first `max` summed as one, `model="(other)"`.
fn top_models(models: &[ModelInfo], max: usize) -> Vec<ModelInfo> {
    let mut out: Vec<ModelInfo> = models.iter().take(max).cloned().collect();
    if models.len() > max {
        let mut other = ModelInfo { model: "(other)".into(), label: "(other)".into(), ..Default::default() };
        for m in &models[max..] {
            other.add(m);
        }
        out.push(other);
    }
    out
}

impl Collector for StoreCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), Error> {
        let snap = Snapshot::take(&self.plane);
        let s = &snap.stats;
        let sh = &s.sharing;
        let b = Some(&Unit::Bytes);
        let e = &mut e;
        gauge(e, "segments", "Segments (sealed memfds) in the index", None, s.segments)?;
        gauge(e, "entries", "Packed tensors across the segments in the index", None, s.entries)?;
        gauge(e, "leases", "Leases held by connected workers", None, s.leases)?;
        gauge(e, "connections", "Connected data-plane clients", None, s.clients)?;
        gauge(e, "control_connections", "Open control-plane (gRPC) connections", None, snap.control.0)?;
        gauge(e, "resident", "Bytes of the segments in the index as charged to the budget", b, s.bytes_resident)?;
        gauge(e, "budget", "The byte budget for segments in the index", b, s.budget_bytes)?;
        gauge(e, "zombie", "Bytes of evicted segments workers still map", b, s.zombie_bytes)?;
        gauge(e, "lent", "Bytes of memfds lent to engine builders, not yet published", b, snap.lends.bytes)?;
        gauge(e, "reserved", "Bytes reserved by running pack jobs and publications", b, s.reserved_bytes)?;
        gauge(e, "spare", "Bytes kept allocated for the next pack job, counted in the budget", b, s.spare_bytes)?;
        gauge(e, "published", "Bytes of engine-published segments in the index", b, s.published_bytes)?;
        gauge(
            e,
            "mapped",
            "Bytes mapped by all connected workers: each segment's size times the workers holding it",
            b,
            sh.bytes_mapped,
        )?;
        gauge(
            e,
            "saved",
            "Bytes sharing saves: mapped bytes minus each mapped segment's size once",
            b,
            sh.bytes_saved,
        )?;
        gauge(e, "private", "Bytes connected workers report holding privately", b, sh.private_bytes)?;
        let workers = [
            ([("state", "served")], sh.workers_served),
            ([("state", "building")], sh.workers_building),
            ([("state", "private")], sh.workers_private),
        ];
        gauges(
            e,
            "workers",
            "Connected workers by how they got weights (one worker may be in several)",
            None,
            &workers,
        )?;
        gauge(e, "builds_active", "Builder roles held now", None, s.builds_active)?;
        let uptime = ConstGauge::new(s.uptime_seconds);
        uptime.encode(e.encode_descriptor(
            "uptime",
            "Seconds since the daemon started",
            Some(&Unit::Seconds),
            uptime.metric_type(),
        )?)?;

        let fallbacks: Vec<([(&str, &str); 1], u64)> =
            s.reports.by_reason().map(|(r, n)| ([("reason", r)], n)).collect();
        let mut m = e.encode_descriptor(
            "private_fallbacks",
            "Private fallbacks workers reported, by reason (a report repeating a connection's latest one for the model is not counted again)",
            None,
            MetricType::Counter,
        )?;
        for (labels, n) in &fallbacks {
            ConstCounter::new(*n).encode(m.encode_family(labels)?)?;
        }
        counter(e, "worker_reports", "Worker reports received", None, s.reports.received)?;
        counter(
            e,
            "worker_reports_dropped",
            "Worker reports not kept at limits.max_reports_per_connection",
            None,
            s.reports.dropped,
        )?;
        let counters: [(&str, &str, u64); 27] = [
            ("hits", "Requests served by a segment packed or being packed", s.hits),
            ("misses", "Requests that started a pack job", s.misses),
            ("pack_jobs", "Pack jobs started", s.pack_jobs),
            ("pack_failures", "Pack jobs that failed", s.pack_failures),
            ("request_errors", "Data-plane requests answered with an error", s.request_errors),
            ("evictions", "Segments evicted by the budget or by Evict", s.evictions),
            ("connections_shed", "Idle connections closed to admit newer ones at a limit", snap.shed),
            ("connections_refused", "Connections refused at a connection limit", snap.refused),
            (
                "control_connections_refused",
                "Control-plane connections closed at once at a connection limit",
                snap.control.1,
            ),
            ("publishes", "Publications accepted", s.publishes),
            ("publishes_refused", "Publications refused", s.publishes_refused),
            ("publishes_withdrawn", "Publications withdrawn after their hash failed", s.publishes_withdrawn),
            ("aliases_filed", "Provisional names filed to publications", s.aliases_filed),
            ("builds", "Builder roles handed out", s.builds),
            ("build_waits", "Acquires that waited for another worker's build", s.build_waits),
            ("builds_expired", "Builder roles ended by their deadline", s.builds_expired),
            ("builds_abandoned", "Builder roles ended by their connection closing", s.builds_abandoned),
            ("builds_given_up", "Builder roles given up with nothing to publish", s.builds_given_up),
            ("build_waits_slow", "Waits for a build ended because building privately was faster", s.build_waits_slow),
            ("builds_refused", "Acquires refused a builder role at a limit", s.builds_refused),
            ("builds_lent", "Builder roles that came with memory packd allocated", snap.lends.handed),
            (
                "lends_refused",
                "Digest requests with build_bytes lent nothing (over a bound or no room)",
                snap.lends.refused,
            ),
            ("lends_revoked", "Lent memory taken back for room before a builder claimed it", s.lends_revoked),
            ("lends_expired", "Lent memory freed because no builder claimed it in time", snap.lends.expired),
            ("source_hashes", "Source files hashed in full", snap.source_hashes),
            ("duplicates_dropped", "Pack jobs whose result was a copy of a served model", s.duplicates_dropped),
            ("log_lines_suppressed", "Per-request log lines left out at the log budget", snap.suppressed),
        ];
        for (name, help, v) in counters {
            counter(e, name, help, None, v)?;
        }

        let models = top_models(&snap.models, self.max_models);
        let labelled: Vec<(String, String, &ModelInfo)> =
            models.iter().map(|m| (label_value(&m.model), label_value(&m.label), m)).collect();
        let rows = |f: fn(&ModelInfo) -> u64| -> Vec<([(&str, &str); 2], u64)> {
            labelled.iter().map(|(id, label, m)| ([("model", id.as_str()), ("label", label.as_str())], f(m))).collect()
        };
        gauges(
            e,
            "model_resident",
            "A model's segments' bytes as charged to the budget",
            b,
            &rows(|m| m.bytes_resident),
        )?;
        gauges(
            e,
            "model_mapped",
            "A model's segment sizes times the workers mapping them",
            b,
            &rows(|m| m.sharing.bytes_mapped),
        )?;
        gauges(e, "model_saved", "Bytes sharing a model saves", b, &rows(|m| m.sharing.bytes_saved))?;
        gauges(
            e,
            "model_private",
            "Bytes workers report holding a model's weights privately",
            b,
            &rows(|m| m.sharing.private_bytes),
        )?;
        let mut m = e.encode_descriptor(
            "model_workers",
            "Workers of a model by how they got its weights",
            None,
            MetricType::Gauge,
        )?;
        for (id, label, info) in &labelled {
            for (state, n) in [
                ("served", info.sharing.workers_served),
                ("building", info.sharing.workers_building),
                ("private", info.sharing.workers_private),
            ] {
                let labels = [("model", id.as_str()), ("label", label.as_str()), ("state", state)];
                ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX)).encode(m.encode_family(&labels)?)?;
            }
        }
        let info =
            [("isa", self.plane.packer.kernels.get().to_string()), ("version", env!("CARGO_PKG_VERSION").to_string())];
        let mut m = e.encode_descriptor("build", "The daemon's version and packing ISA", None, MetricType::Info)?;
        m.encode_info(&info)?;
        Ok(())
    }
}
