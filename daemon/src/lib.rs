//! packd: packs model weights once per host into sealed memfd segments and shares them
//! with inference processes over a Unix socket.
//!
//! Layers, dependencies pointing one way: [`sys`] (system calls) → [`source`], [`pack`]
//! (pure logic) → [`store`] (state) → [`service`] (its [`service::Packer`]: what packing
//! needs) → [`dataplane`], [`control`] (each with a handle of what it uses),
//! [`persist`] (fd store, cache directory) → [`metrics`] (Prometheus exposition) →
//! [`server`] (wiring); [`telemetry`] (counters recorded on the request path) sits with the
//! pure logic. There is no handle to
//! everything: each part is given what it uses.
//! The library also exposes [`pack`] (layouts, reference kernels) to tests and benches.

pub mod access;
pub mod blocking;
pub mod config;
pub mod control;
pub mod dataplane;
pub mod key;
pub mod limits;
pub mod metrics;
pub mod pack;
pub mod persist;
pub mod ratelog;
pub mod server;
pub mod service;
pub mod source;
pub mod store;
pub mod sys;
pub mod telemetry;
