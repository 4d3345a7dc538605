//! What the daemon records as it works, for the metrics (`packd_requests_total`, request and
//! pack durations, bytes packed, segments restored): counters and histograms updated on the
//! request path with a few atomic operations, read at each scrape. Everything else the
//! metrics show is read from the store when scraped. Label sets are fixed (operations and
//! codes are `&'static str`s): no client can grow them.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// A data-plane request's operation and how it ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpCode {
    /// pack, get, acquire, publish, release, give_up, report, none.
    pub op: &'static str,
    /// ok, build, private, none, or the error code in lowercase (not_found, ...).
    pub code: &'static str,
}

/// A data-plane request's operation.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Op {
    /// As in [`OpCode`].
    pub op: &'static str,
}

/// Where restored segments came from.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct From {
    /// `fd_store` or `cache_dir`.
    pub from: &'static str,
}

/// Request latencies, seconds: from 100 µs (a get of a packed key) to minutes (a pack).
const REQUEST_BUCKETS: [f64; 14] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0, 30.0, 120.0, 600.0];
/// Pack job durations, seconds.
const PACK_BUCKETS: [f64; 10] = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0, 300.0];

/// The recorded metrics.
#[derive(Debug)]
pub struct Telemetry {
    requests: Family<OpCode, Counter>,
    request_seconds: Family<Op, Histogram>,
    pack_seconds: Histogram,
    packed_bytes: Counter,
    restored: Family<From, Counter>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            request_seconds: Family::new_with_constructor(|| Histogram::new(REQUEST_BUCKETS)),
            pack_seconds: Histogram::new(PACK_BUCKETS),
            packed_bytes: Counter::default(),
            restored: Family::default(),
        }
    }
}

impl Telemetry {
    /// Counts a request of `op` that ended with `code` after `took`.
    pub fn request(&self, op: &'static str, code: &'static str, took: Duration) {
        self.requests.get_or_create(&OpCode { op, code }).inc();
        self.request_seconds.get_or_create(&Op { op }).observe(took.as_secs_f64());
    }

    /// Counts a successful pack job of `bytes` that took `took`.
    pub fn packed(&self, bytes: u64, took: Duration) {
        self.pack_seconds.observe(took.as_secs_f64());
        self.packed_bytes.inc_by(bytes);
    }

    /// Counts `n` segments restored from `from` (`fd_store` or `cache_dir`).
    pub fn restored(&self, from: &'static str, n: u64) {
        self.restored.get_or_create(&From { from }).inc_by(n);
    }

    /// Registers the recorded metrics (clones share the values) in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "requests",
            "Data-plane requests by operation and outcome (ok, build, private, none, or the error code)",
            self.requests.clone(),
        );
        registry.register_with_unit(
            "request_duration",
            "Data-plane request latency from the whole frame read to the answer, by operation",
            Unit::Seconds,
            self.request_seconds.clone(),
        );
        registry.register_with_unit(
            "pack_duration",
            "Duration of successful pack jobs",
            Unit::Seconds,
            self.pack_seconds.clone(),
        );
        registry.register_with_unit(
            "packed",
            "Bytes of segments packed by successful pack jobs",
            Unit::Bytes,
            self.packed_bytes.clone(),
        );
        registry.register(
            "restored_segments",
            "Segments served again after a restart, by where they came from (fd_store, cache_dir)",
            self.restored.clone(),
        );
    }
}

/// `elapsed` in milliseconds rounded to 0.1 ms, for log fields (`ms=207.8`, not
/// `ms=207.76920099999998`).
pub fn log_ms(elapsed: std::time::Duration) -> f64 {
    (elapsed.as_secs_f64() * 1e4).round() / 10.0
}

#[cfg(test)]
mod log_ms_tests {
    #[test]
    fn log_fields_carry_a_tenth_of_a_millisecond() {
        assert_eq!(super::log_ms(std::time::Duration::from_nanos(207_769_201)), 207.8);
        assert_eq!(super::log_ms(std::time::Duration::ZERO).to_string(), "0");
    }
}
