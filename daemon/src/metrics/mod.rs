//! Prometheus metrics: what the host shares and saves, how workers got their weights, and
//! what the daemon does, in the OpenMetrics 1.0 text format. Served on a loopback HTTP
//! listener (`metrics_listen`, or a socket passed as `metrics`); `packctl metrics` prints
//! the same text over the control plane. docs/OPERATIONS.md names every metric.
//!
//! At each scrape one snapshot of the store is taken (one lock, O(segments + connections));
//! per-model series are limited to the `metrics_max_models` models with the most resident
//! bytes, the rest summed under `model="(other)"`, so a store of many models does not make
//! a large or slow scrape.
//!
//! Why `prometheus-client` (the Prometheus project's own Rust client) and not `metrics` with
//! its exporter: its custom collectors let a scrape read one snapshot of the store instead
//! of mirroring every figure into global gauges as it changes; its registry belongs to this
//! daemon instance (no global recorder, so tests and harnesses run several side by side);
//! and it only encodes text, leaving the listener to packd's own bounded HTTP server rather
//! than bringing one of its own.

mod collect;
pub mod http;

use std::sync::Arc;

use prometheus_client::registry::Registry;

use crate::control::ControlPlane;

pub use collect::Snapshot;

/// Renders the metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
}

impl Metrics {
    /// The metrics of `plane` (its store and counts, and the packer's telemetry), with at
    /// most `max_models` models labelled one by one.
    pub fn new(plane: Arc<ControlPlane>, max_models: usize) -> Self {
        let mut registry = Registry::with_prefix("packd");
        plane.packer.telemetry.register(&mut registry);
        registry.register_collector(Box::new(collect::StoreCollector { plane, max_models }));
        Self { registry }
    }

    /// The exposition text (OpenMetrics 1.0, which Prometheus reads).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 << 10);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The Content-Type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
