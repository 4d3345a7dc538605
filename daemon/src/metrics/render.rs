//! The registry and its text.

use std::sync::Arc;

use prometheus_client::registry::Registry;

use super::collect;
use crate::control::ControlPlane;

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
