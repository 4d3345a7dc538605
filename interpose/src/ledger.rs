//! What every adapter keeps of its work: one [`Ledger`] of counts (flattened into each
//! adapter's status), the [`Journal`] that holds an adapter's status for the process and
//! counts into it, the typed reason work went private ([`Private`]), and the process's one
//! connection to packd for reports.
//!
//! A unit of work is what an adapter asks packd for: an XNNPACK runtime, a llama.cpp
//! buffer, a LiteRT model. Each ends `served` (mapped from packd), `built` (built here and
//! published) or `private` (as the engine alone, with a reason).

#![forbid(unsafe_code)]

use std::fs::File;
use std::sync::{Condvar, LazyLock, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use packd_client::Fallback;
use packd_client::{Client, ProtocolError, PublishEntry, Report, Segment};
use serde::Serialize;

use crate::status::Reasons;

/// The counts and words every adapter's status holds, with these names (its JSON keys).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Ledger {
    /// The engine's library (the one that defines its API), once found.
    pub engine: Option<String>,
    /// Units of work served: mapped from packd, nothing packed here.
    pub served: u64,
    /// Units this process built and packd accepted (published).
    pub built: u64,
    /// Units done as the engine alone, for the `reasons` below.
    pub private: u64,
    /// Bytes mapped from packd (served, or built and published).
    pub bytes_shared: u64,
    /// Bytes the engine holds privately (as far as the adapter can tell).
    pub bytes_private: u64,
    /// Microseconds asking packd (with waiting for another process's build).
    pub acquire_us: u64,
    /// Microseconds publishing: from the start of the publication to packd's answer.
    pub publish_us: u64,
    /// Why units went private, with counts (`reasons`), and the same by reason as packd
    /// counts them (`fallbacks`: `daemon_away`, `unknown_interface`, ...).
    #[serde(flatten)]
    pub why: Reasons,
}

/// How an adapter that names a whole model names it, which its status shows beside the
/// ledger (flattened: these fields' names): the engine's libraries with their builds, the
/// last identity asked for, and the time spent naming.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Naming {
    /// The engine's libraries, each with the digest or build-id that names its build, once
    /// found.
    pub libraries: Vec<String>,
    /// The identity of the last unit of work asked for.
    pub identity: Option<String>,
    /// Microseconds naming the model and the engine (digests, from packd: once per host).
    pub identify_us: u64,
}

/// A status that holds a [`Ledger`] (flattened: `#[serde(flatten)] ledger: Ledger`), and
/// is written as JSON with `status::to_json`.
pub trait Keeps: Default + Send + Serialize + 'static {
    /// The ledger inside.
    fn ledger(&mut self) -> &mut Ledger;
}

/// The whole status of an adapter that names whole models (LiteRT, ONNX Runtime), flattened
/// into one JSON object: its count of units asked about (`units`, a struct of one field whose
/// name is the unit's: `models`, `sessions`), its [`Naming`] and its [`Ledger`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ModelStatus<U> {
    /// Units of work packd was asked about, each `served`, `built` or `private`.
    #[serde(flatten)]
    pub units: U,
    /// The engine's libraries, the last identity and the time naming.
    #[serde(flatten)]
    pub naming: Naming,
    /// What every adapter counts.
    #[serde(flatten)]
    pub ledger: Ledger,
}

impl<U: Default + Send + Serialize + 'static> Keeps for ModelStatus<U> {
    fn ledger(&mut self) -> &mut Ledger {
        &mut self.ledger
    }
}

/// Why a unit of work runs as the engine alone: the reason as packd counts it, and what
/// happened.
#[derive(Debug, thiserror::Error)]
#[error("{why}")]
pub struct Private {
    /// As packd counts it.
    pub fallback: Fallback,
    /// What happened (boxed: a `Result` with it stays small).
    pub why: Box<Why>,
}

/// What happened, typed: each variant says it in words.
#[derive(Debug, thiserror::Error)]
pub enum Why {
    /// A fixed sentence.
    #[error("{0}")]
    Said(&'static str),
    /// packd could not be reached, or answered with an error (`what`: at which step).
    #[error("{what}: {source}")]
    Packd {
        /// The step.
        what: &'static str,
        /// packd's answer.
        #[source]
        source: packd_client::Error,
    },
    /// A system call failed (`what`: which step).
    #[error("{what}: {source}")]
    Io {
        /// The step.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The adapter's own error (its own type, which says it in words).
    #[error(transparent)]
    Adapter(Box<dyn std::error::Error + Send + Sync>),
    /// Words from outside the adapter: packd's (it told the worker to work privately), or
    /// the caller's (its reason to leave packd out, the engine's error).
    #[error("{0}")]
    Given(String),
    /// The engine failed at step `what` (`"LiteRT failed to compile the model"`), in its own
    /// words (an exception's text the caller passes on).
    #[error("{what}: {words}")]
    Engine {
        /// The step, as the adapter names it.
        what: &'static str,
        /// The engine's words.
        words: String,
    },
}

impl Private {
    /// A fixed sentence.
    pub fn said(fallback: Fallback, words: &'static str) -> Self {
        Self { fallback, why: Box::new(Why::Said(words)) }
    }

    /// packd's error at step `what`, counted as packd's error says (`daemon_away`, ...).
    pub fn packd(what: &'static str, e: packd_client::Error) -> Self {
        Self { fallback: e.fallback(), why: Box::new(Why::Packd { what, source: e }) }
    }

    /// A failed system call at step `what`: this worker's error.
    pub fn io(what: &'static str, e: std::io::Error) -> Self {
        Self { fallback: Fallback::WorkerError, why: Box::new(Why::Io { what, source: e }) }
    }

    /// Words from outside the adapter (packd's answer, the caller's reason).
    pub fn given(fallback: Fallback, words: String) -> Self {
        Self { fallback, why: Box::new(Why::Given(words)) }
    }

    /// The engine failed at step `what`, in its own `words`: this worker's error.
    pub fn engine(what: &'static str, words: &str) -> Self {
        Self { fallback: Fallback::WorkerError, why: Box::new(Why::Engine { what, words: words.to_string() }) }
    }

    /// The adapter's own error `e`, counted as `fallback`.
    pub fn adapter(fallback: Fallback, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self { fallback, why: Box::new(Why::Adapter(Box::new(e))) }
    }
}

/// The identity a segment `asked` for was published under: a segment served for a
/// provisional name (an alias) was published under its content identity, which the reply
/// carries; every worker then reports that one.
pub fn served_identity(segment: &Segment, asked: &str) -> String {
    segment
        .info()
        .publisher
        .as_ref()
        .map(|p| p.identity.as_str())
        .filter(|i| !i.is_empty())
        .unwrap_or(asked)
        .to_string()
}

/// Microseconds in `d` (saturating).
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// How a unit of work got its weights from packd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapped {
    /// Mapped from a segment another process published: nothing packed here.
    Served,
    /// Built here, and packd accepted the publication.
    Built,
}

/// An adapter's status for the life of the process, what it says of private work, and its
/// connection to packd for reports. One `static` an adapter.
///
/// The `model` every call takes names the unit of work as reports and `packctl clients`
/// show it: its identity (the key packd was asked for) once known, else a name for what it
/// is (`"llama.cpp buffer"`, the model's path).
pub struct Journal<S: 'static> {
    status: LazyLock<Mutex<S>>,
    /// The engine as reports name it (`xnnpack`, `llama.cpp`, ...).
    engine: &'static str,
    /// Said on stderr before the reason, the first time each reason is counted.
    says: &'static str,
    client: OnceLock<Client>,
    /// Publications under way ([`Journal::publish_aside`]): this process's pid and their
    /// count (a child forked meanwhile inherits the count but not the threads).
    pending: (Mutex<(u32, usize)>, Condvar),
}

impl<S: Keeps> Journal<S> {
    /// A journal for `engine` (as reports name it: `"xnnpack"`, `"llama.cpp"`) that says
    /// `says: REASON` on stderr once per reason work went private; `says` names the adapter
    /// and what happens, e.g. `"packd-llama: llama.cpp repacks its weights privately"`.
    pub const fn new(engine: &'static str, says: &'static str) -> Self {
        Self {
            status: LazyLock::new(Mutex::default),
            engine,
            says,
            client: OnceLock::new(),
            pending: (Mutex::new((0, 0)), Condvar::new()),
        }
    }

    /// Waits, at most `within`, until the publications this process started
    /// ([`Journal::publish_aside`]) have ended, so that a status read next counts them.
    pub fn settled(&self, within: Duration) {
        let (count, ended) = &self.pending;
        let pending = count.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let me = std::process::id();
        drop(ended.wait_timeout_while(pending, within, |(pid, n)| *pid == me && *n > 0));
    }

    /// A copy of the status, once the publications under way have ended (at most `within`).
    pub fn snapshot(&self, within: Duration) -> S
    where
        S: Clone,
    {
        self.settled(within);
        self.lock().clone()
    }

    /// The status, locked, to read or update.
    pub fn lock(&self) -> MutexGuard<'_, S> {
        self.status.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The engine as reports name it.
    pub fn engine(&self) -> &'static str {
        self.engine
    }

    /// The process's connection for reports and acquires: made on first use, tried again
    /// after a failure, kept for the life of the process. When it fails, the unit goes
    /// private with `Private::packd("packd is away", e)`.
    pub fn client(&self) -> Result<&Client, packd_client::Error> {
        if let Some(c) = self.client.get() {
            return Ok(c);
        }
        let c = Client::connect_default()?;
        Ok(self.client.get_or_init(|| c))
    }

    /// The connection, if one was made.
    pub fn connected(&self) -> Option<&Client> {
        self.client.get()
    }

    /// Adds `d` to the time `field` picks.
    pub fn add_time(&self, field: impl FnOnce(&mut S) -> &mut u64, d: Duration) {
        *field(&mut self.lock()) += micros(d);
    }

    /// Counts a unit of `model` done privately (`bytes` held privately), says why on stderr
    /// the first time this reason is counted, and tells packd: on `client`, else on this
    /// journal's connection if one was made, else on the next connection the process makes.
    pub fn private(&self, model: &str, why: &Private, bytes: u64, client: Option<&Client>) {
        let reason = why.to_string();
        let first = {
            let mut st = self.lock();
            let l = st.ledger();
            l.private += 1;
            l.bytes_private += bytes;
            l.why.count(why.fallback, &reason)
        };
        if first {
            crate::say!("{}: {reason}", self.says);
        }
        let report = Report::private(self.engine, model, why.fallback, &reason, bytes);
        crate::status::report(&report, client.or_else(|| self.connected()));
    }

    /// Counts a unit of `model` mapped from packd (`how`) with its `bytes`, and tells packd
    /// on `client` (the connection that acquired or published it).
    pub fn shared(&self, model: &str, how: Mapped, bytes: u64, client: &Client) {
        {
            let mut st = self.lock();
            let l = st.ledger();
            match how {
                Mapped::Served => l.served += 1,
                Mapped::Built => l.built += 1,
            }
            l.bytes_shared += bytes;
        }
        client.report(&match how {
            Mapped::Served => Report::served(self.engine, model, bytes),
            Mapped::Built => Report::built(self.engine, model, bytes),
        });
    }
}

impl<S: Keeps> Journal<S> {
    /// Publishes the sealed `file` (`len` bytes, `entries`) as `identity` on a thread of its
    /// own (named `thread`), which only waits for packd's answer (packd hashes it); a
    /// publication with [`Publication::sealing`] is sealed there first. Accepted,
    /// the unit is counted built with its publish time and reported at once (a long-lived
    /// worker shows as the builder all its life); refused, the builder role is given up
    /// (its waiters build themselves) and the unit counted private, `bytes` held privately.
    /// The thread ends with `then(segment)` (the segment's lease, or `None`). Err: the
    /// thread could not start (the role given up, nothing counted).
    pub fn publish_aside<T: Send + 'static>(
        &'static self,
        publication: Publication,
        thread: &str,
        then: impl FnOnce(Option<Segment>) -> T + Send + 'static,
    ) -> Result<JoinHandle<T>, Private> {
        let Publication { client, identity, file, len, entries, bytes, renaming, sealing } = publication;
        let giving_up = (client.clone(), identity.clone());
        let underway = Underway::start(&self.pending);
        std::thread::Builder::new()
            .name(thread.into())
            .spawn(move || {
                let _underway = underway;
                let t = Instant::now();
                let sealed = match sealing {
                    None => Ok(()),
                    Some(seal) => {
                        crate::entry::caught(Err(Private::said(Fallback::Other, "sealing the build panicked")), || {
                            seal(&file)
                        })
                    }
                };
                // Under a provisional name: the digest's identity, the provisional one its alias.
                let named = sealed.and_then(|()| match renaming {
                    None => Ok((identity.clone(), None)),
                    Some(r) => {
                        crate::entry::caught(Err(Private::said(Fallback::Other, "naming the model panicked")), || {
                            r.identity()
                        })
                        .map(|(content, named)| (content, Some(named)))
                    }
                });
                let published = named.and_then(|(content, named)| {
                    let aliases: Vec<String> = named.iter().map(|_| identity.clone()).collect();
                    let segment =
                        crate::entry::caught(Err(packd_client::Error::Protocol(ProtocolError::Panicked)), || {
                            client.publish_aliased(&content, &aliases, &file, len, &entries)
                        });
                    // Later workers find the digest now, and ask for what is published (this
                    // build's, or another copy of the model packd had already).
                    let there = match &segment {
                        Ok(_) => true,
                        Err(e) => e.code() == "ALREADY_EXISTS",
                    };
                    if let Some(named) = named.filter(|_| there) {
                        named.remember();
                    }
                    Ok((content, segment.map_err(|e| Private::packd("publishing failed", e))?))
                });
                self.add_time(|s| &mut s.ledger().publish_us, t.elapsed());
                let segment = match published {
                    Ok((content, segment)) => {
                        self.shared(&content, Mapped::Built, len, &client);
                        Some(segment)
                    }
                    Err(why) => {
                        // Nothing published: the role (the provisional name's) is given up,
                        // and its waiters build themselves.
                        client.give_up(&identity, &why.to_string());
                        self.private(&identity, &why, bytes, Some(&client));
                        None
                    }
                };
                then(segment)
            })
            .map_err(|e| {
                let why = Private::io("cannot start publishing", e);
                giving_up.0.give_up(&giving_up.1, &why.to_string());
                why
            })
    }
}

/// Where a publication's segment (packd's lease on it) lands once packd accepted it
/// ([`Journal::publish_kept`]); `None` until then, or when it was refused.
pub type Kept = std::sync::Arc<Mutex<Option<Segment>>>;

impl<S: Keeps> Journal<S> {
    /// [`Journal::publish_aside`] of `publication` (most often [`Publication::of_duplicate`]),
    /// whose segment lands in the slot returned if the slot still exists by then (the unit
    /// that holds it keeps the lease as long as it lives).
    pub fn publish_kept(&'static self, publication: Publication, thread: &str) -> Result<Kept, Private> {
        let slot: Kept = std::sync::Arc::new(Mutex::new(None));
        let weak = std::sync::Arc::downgrade(&slot);
        self.publish_aside(publication, thread, move |segment| {
            if let (Some(segment), Some(slot)) = (segment, weak.upgrade()) {
                *slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(segment);
            }
        })?;
        Ok(slot)
    }
}

/// One publication under way, counted from its start until this is dropped (also when its
/// thread panics, or never starts).
struct Underway(&'static (Mutex<(u32, usize)>, Condvar));

impl Underway {
    fn start(pending: &'static (Mutex<(u32, usize)>, Condvar)) -> Self {
        let mut c = pending.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let me = std::process::id();
        *c = if c.0 == me { (me, c.1 + 1) } else { (me, 1) };
        Self(pending)
    }
}

impl Drop for Underway {
    fn drop(&mut self) {
        let mut c = self.0.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        c.1 = c.1.saturating_sub(1);
        self.0.1.notify_all();
    }
}

/// A sealed build to publish ([`Journal::publish_aside`]).
pub struct Publication {
    /// The builder's connection (the one that holds the builder role).
    pub client: Client,
    /// What the build is of (the role's identity).
    pub identity: String,
    /// The memfd: sealed, or sealed by [`Publication::sealing`].
    pub file: File,
    /// Its length.
    pub len: u64,
    /// Its entries.
    pub entries: Vec<PublishEntry>,
    /// Bytes the engine keeps privately if packd refuses it.
    pub bytes: u64,
    /// A build started under a provisional name (`identity`): published under the identity
    /// its model's digest makes, with `identity` as its alias, once the digest is known.
    pub renaming: Option<Renaming>,
    /// How the build is sealed, on the publication's thread before anything else: for a
    /// builder whose engine goes on meanwhile (remapping the build read-only and sealing it
    /// takes tens of milliseconds for hundreds of MiB). Err: nothing is published and the
    /// role is given up. `None`: `file` is sealed already.
    pub sealing: Option<Sealing>,
}

/// Seals a build's memfd ([`Publication::sealing`]).
pub type Sealing = Box<dyn FnOnce(&File) -> Result<(), Private> + Send>;

/// How a build started under a provisional name is published ([`Publication::renaming`]):
/// the model's digest being computed, and how the identity is made of it.
pub struct Renaming {
    /// The model file's digest, computed beside the build.
    pub digest: crate::memo::PendingDigest,
    /// The identity the build has, given the model files' digests (each `name` `c:…`), in
    /// the order the provisional name took the files.
    pub identity_of: IdentityOf,
}

/// A builder under a provisional name starts finding its model's digests beside the build
/// (`provisional`, and what the adapter makes its identity with: `with`), on a connection of
/// their own (packd answers a connection's requests in turn: on the builder's `client`, the
/// hash would hold back its progress reports and a give-up); if the thread cannot start, the
/// role of `identity` is given up on `client` and the unit is private.
pub fn digest_beside<T>(
    provisional: Option<(crate::memo::Provisional, T)>,
    client: &Client,
    identity: &str,
) -> Result<Option<(crate::memo::PendingDigest, T)>, Private> {
    let Some((p, with)) = provisional else { return Ok(None) };
    match p.digest_beside(Client::connect_default().ok()) {
        Ok(pending) => Ok(Some((pending, with))),
        Err(e) => {
            let why = Private::io("cannot start the model's digest", e);
            client.give_up(identity, &why.to_string());
            Err(why)
        }
    }
}

/// Makes a build's identity of its model files' digests ([`Renaming::identity_of`]).
pub type IdentityOf = Box<dyn FnOnce(&[crate::memo::FileDigest]) -> String + Send>;

impl Publication {
    /// A publication of a duplicate of the sealed `file` (`len` bytes, `entries`) as
    /// `identity`, nothing held privately if refused, no renaming. A file that cannot be
    /// duplicated gives the role up.
    pub fn of_duplicate(
        client: Client,
        identity: String,
        file: &File,
        len: u64,
        entries: Vec<PublishEntry>,
    ) -> Result<Self, Private> {
        match file.try_clone() {
            Ok(file) => Ok(Self { client, identity, file, len, entries, bytes: 0, renaming: None, sealing: None }),
            Err(e) => {
                let why = Private::io("cannot duplicate the build's fd", e);
                client.give_up(&identity, &why.to_string());
                Err(why)
            }
        }
    }
}

impl Renaming {
    /// The identity to publish under: the digest's, once known and the model file did not
    /// change during the build.
    fn identity(self) -> Result<(String, crate::memo::Named), Private> {
        match self.digest.finish() {
            Ok(named) => Ok(((self.identity_of)(&named.digests), named)),
            Err(e) => Err(Private::adapter(Fallback::UnnamedWeights, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default, Serialize)]
    struct Probe {
        units: u64,
        #[serde(flatten)]
        ledger: Ledger,
    }

    impl Keeps for Probe {
        fn ledger(&mut self) -> &mut Ledger {
            &mut self.ledger
        }
    }

    static PROBE: Journal<Probe> = Journal::new("probe", "probe runs privately");

    #[test]
    fn the_ledger_counts_private_work_by_typed_reason_and_writes_one_vocabulary() {
        let io = std::io::Error::from_raw_os_error(libc::ENOMEM);
        PROBE.private("m", &Private::io("cannot seal the build", io), 4096, None);
        PROBE.private("m", &Private::said(Fallback::UnnamedWeights, "no weight could be named"), 0, None);
        PROBE.private("m", &Private::said(Fallback::UnnamedWeights, "no weight could be named"), 0, None);
        PROBE.lock().units = 3;
        let json: serde_json::Value = serde_json::from_str(&crate::status::to_json(&*PROBE.lock())).unwrap();
        assert_eq!(json["private"], 3);
        assert_eq!(json["bytes_private"], 4096);
        assert_eq!(json["units"], 3);
        assert_eq!(json["reasons"]["no weight could be named"], 2);
        assert_eq!(json["fallbacks"]["unnamed_weights"], 2);
        assert_eq!(json["fallbacks"]["worker_error"], 1);
        let words = json["reasons"].as_object().unwrap().keys().find(|k| k.starts_with("cannot seal")).unwrap().clone();
        assert!(words.starts_with("cannot seal the build: ") && words.len() > 24, "{words}");
        for key in ["engine", "served", "built", "bytes_shared", "acquire_us", "publish_us"] {
            assert!(json.get(key).is_some(), "{key} missing: {json}");
        }
    }
}
