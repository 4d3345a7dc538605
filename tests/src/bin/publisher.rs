//! A client process for the publish tests: acquires a cache identity and, when it is made
//! the builder, builds a segment (a sealed memfd of deterministic bytes) and publishes it.
//! Prints one JSON line: `{"got":"segment"|"built"|"private"|"error", ...}`.
//!
//!   publisher DIR IDENTITY [--entries N] [--seed S] [--publish-when FILE] [--hang] [--hold S]
//!             [--build-seconds S] [--wait-seconds S] [--lend FILE BYTES]
//!
//! `--publish-when FILE` waits, once the builder, until FILE exists (at most a minute)
//! before publishing (a build the test ends when it has seen the others wait);
//! `--hang` never publishes (a builder that stalls until killed); `--hold` keeps the
//! process (and its lease) alive after printing; `--report` tells packd what it got, as an
//! engine integration does (served, built, or private with the reason); `--lend FILE BYTES`
//! first asks for FILE's digest for a build of BYTES (opting in to lent memory) and acquires
//! with that `build_bytes`; "building" and "built" then say how many bytes were lent.
//!
//!   publisher DIR --report-only ENGINE MODEL REASON BYTES [--hold S]
//!
//! sends one private report (REASON a lowercase fallback name such as `build_timeout`)
//! without acquiring anything.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use packd_client::report::fallback_name;
use packd_client::{AcquireOptions, Acquired, Client, Fallback, PublishEntry, Report};

struct Args {
    dir: String,
    identity: String,
    entries: u64,
    seed: u8,
    publish_when: Option<std::path::PathBuf>,
    hang: bool,
    hold: u64,
    options: AcquireOptions,
    get: Option<String>,
    report: bool,
    lend: Option<(String, u64)>,
}

fn parse() -> Args {
    let mut it = std::env::args().skip(1);
    let dir = it.next().expect("usage: publisher DIR IDENTITY [options]");
    let identity = it.next().expect("usage: publisher DIR IDENTITY [options]");
    let mut a = Args {
        dir,
        identity,
        entries: 3,
        seed: 1,
        publish_when: None,
        hang: false,
        hold: 0,
        options: AcquireOptions::default(),
        get: None,
        report: false,
        lend: None,
    };
    while let Some(flag) = it.next() {
        let mut num = || it.next().and_then(|v| v.parse::<u64>().ok()).expect("a number after the flag");
        match flag.as_str() {
            "--entries" => a.entries = num(),
            "--seed" => a.seed = u8::try_from(num()).expect("seed fits a byte"),
            "--publish-when" => a.publish_when = it.next().map(Into::into),
            "--hold" => a.hold = num(),
            "--build-seconds" => a.options.build_seconds = u32::try_from(num()).expect("seconds"),
            "--wait-seconds" => a.options.wait_seconds = u32::try_from(num()).expect("seconds"),
            "--hang" => a.hang = true,
            "--get" => a.get = it.next(),
            "--report" => a.report = true,
            "--lend" => {
                let file = it.next().expect("a file after --lend");
                let bytes = it.next().and_then(|v| v.parse().ok()).expect("bytes after the file");
                a.options.build_bytes = bytes;
                a.lend = Some((file, bytes));
            }
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// The segment a builder of `entries` entries with `seed` publishes: entry i is 100 + i
/// bytes at offset 128 × i, each byte `seed + i + j`.
pub fn build(entries: u64, seed: u8) -> (std::fs::File, u64, Vec<PublishEntry>) {
    let file = memfd::MemfdOptions::default().allow_sealing(true).create("publisher").expect("memfd").into_file();
    let size = (entries * 128).div_ceil(4096).max(1) * 4096;
    file.set_len(size).expect("set_len");
    let mut table = Vec::new();
    for i in 0..entries {
        let bytes: Vec<u8> = (0..100 + i).map(|j| seed.wrapping_add((i + j).to_le_bytes()[0])).collect();
        file.write_all_at(&bytes, 128 * i).expect("write");
        table.push(PublishEntry { key: format!("op{i}"), offset: 128 * i, length: 100 + i });
    }
    let mfd = memfd::Memfd::try_from_file(file).expect("a memfd");
    mfd.add_seals(&[
        memfd::FileSeal::SealShrink,
        memfd::FileSeal::SealGrow,
        memfd::FileSeal::SealWrite,
        memfd::FileSeal::SealSeal,
    ])
    .expect("seal");
    (mfd.into_file(), size, table)
}

/// `--report-only ENGINE MODEL REASON BYTES [--hold S]`.
fn report_only() -> bool {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.get(1).map(String::as_str) != Some("--report-only") {
        return false;
    }
    let [dir, _, engine, model, reason, bytes, rest @ ..] = args.as_slice() else {
        panic!("usage: publisher DIR --report-only ENGINE MODEL REASON BYTES [--hold S]")
    };
    let fallback = Fallback::from_str_name(&reason.to_ascii_uppercase())
        .or_else(|| Fallback::from_str_name(&format!("FALLBACK_{}", reason.to_ascii_uppercase())))
        .expect("a fallback name");
    let report = Report::private(engine, model, fallback, &format!("forced: {reason}"), bytes.parse().expect("bytes"));
    let hold = match rest {
        [flag, s] if flag == "--hold" => s.parse().expect("seconds"),
        _ => 0,
    };
    if fallback == Fallback::DaemonAway {
        // As an engine does when packd cannot be reached: kept, sent by the next connection.
        assert!(packd_client::report_later(&report), "kept");
        println!(r#"{{"got":"waiting"}}"#);
        let _ = std::io::stdout().flush();
        let until = std::time::Instant::now() + Duration::from_secs(60);
        let client = loop {
            match Client::connect(dir) {
                Ok(c) => break c,
                Err(_) if std::time::Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => panic!("packd never came: {e}"),
            }
        };
        finish(r#"{"got":"reported"}"#, hold, None);
        drop(client);
        return true;
    }
    let client = Client::connect(dir).expect("connect");
    client.report(&report);
    finish(r#"{"got":"reported"}"#, hold, None);
    drop(client);
    true
}

fn main() {
    if report_only() {
        return;
    }
    let a = parse();
    let client = Client::connect(&a.dir).expect("connect");
    let report = |r: Report| {
        if a.report {
            client.report(&r);
        }
    };
    if let Some(key) = &a.get {
        let line = match client.get_segment(key) {
            Ok(seg) => format!(r#"{{"got":"segment","key":"{}"}}"#, seg.info().key),
            Err(e) => format!(r#"{{"got":"error","code":"{}"}}"#, e.code()),
        };
        finish(&line, 0, None);
        return;
    }
    if let Some((file, bytes)) = &a.lend {
        let f = std::fs::File::open(file).expect("open the file to lend for");
        client.file_digest_for_build(&f, *bytes).expect("digest");
    }
    let line = match client.acquire(&a.identity, a.options) {
        Ok(Acquired::Segment(seg)) => {
            let model = seg.map().expect("map");
            // A waiter may be served before packd hashed the publication: nothing to verify
            // against yet.
            let pending = model.info().digests_pending;
            if !pending {
                model.verify().expect("verify");
            }
            let digest = blake3::hash(model.bytes());
            report(Report::served("publisher", &a.identity, model.info().size));
            let line = format!(
                r#"{{"got":"segment","blake3":"{digest}","entries":{},"key":"{}","pending":{pending}}}"#,
                model.len(),
                model.key()
            );
            finish(&line, a.hold, Some(model));
            return;
        }
        Ok(Acquired::Build { memory, .. }) => {
            let lent = memory.as_ref().map_or(0, |m| m.metadata().expect("fstat").len());
            if a.hang {
                println!(r#"{{"got":"building","lent":{lent}}}"#);
                let _ = std::io::stdout().flush();
                std::thread::sleep(Duration::from_secs(3600));
            }
            if let Some(file) = &a.publish_when {
                let until = std::time::Instant::now() + Duration::from_secs(60);
                while !file.exists() && std::time::Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            let (file, size, table) = build(a.entries, a.seed);
            match client.publish(&a.identity, &file, size, &table) {
                Ok(seg) => {
                    let model = seg.map().expect("map");
                    let digest = blake3::hash(model.bytes());
                    report(Report::built("publisher", &a.identity, size));
                    let line = format!(
                        r#"{{"got":"built","blake3":"{digest}","entries":{},"key":"{}","lent":{lent}}}"#,
                        model.len(),
                        model.key()
                    );
                    finish(&line, a.hold, Some(model));
                    return;
                }
                Err(e) => {
                    report(Report::private("publisher", &a.identity, e.fallback(), &e.to_string(), size));
                    format!(r#"{{"got":"error","code":"{}","fallback":"{}"}}"#, e.code(), fallback_name(e.fallback()))
                }
            }
        }
        Ok(Acquired::Private { fallback, reason }) => {
            report(Report::private("publisher", &a.identity, fallback, &reason, 4096));
            format!(r#"{{"got":"private","reason":{reason:?},"fallback":"{}"}}"#, fallback_name(fallback))
        }
        Err(e) => format!(r#"{{"got":"error","code":"{}"}}"#, e.code()),
    };
    finish(&line, a.hold, None);
}

fn finish(line: &str, hold: u64, keep: Option<packd_client::Model>) {
    println!("{line}");
    let _ = std::io::stdout().flush();
    std::thread::sleep(Duration::from_secs(hold));
    drop(keep);
}
