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
mod render;

pub use collect::Snapshot;
pub use render::{CONTENT_TYPE, Metrics};
