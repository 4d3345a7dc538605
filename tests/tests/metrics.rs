//! What the host shares, saves and falls back on, as operators see it: workers' reports in
//! GetStats / ListClients / ListModels, the Prometheus metrics served by a real packd over
//! HTTP (and scraped by a real Prometheus), and `packctl top` in a real terminal (tmux).
//! Every fallback reason is forced once.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use packd_tests::{Daemon, Held, free_port, http_get, wait_until};

/// The value of the sample `series` (name with labels, exactly as exposed).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')).and_then(|v| v.parse().ok()))
}

fn publisher(d: &Daemon, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_publisher"));
    cmd.arg(d.dir()).args(args).stdout(Stdio::piped()).stderr(Stdio::inherit());
    cmd
}

fn first_line(child: &mut Child) -> serde_json::Value {
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("stdout")).read_line(&mut line).expect("read");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("publisher printed {line:?}: {e}"))
}

fn fallbacks(d: &Daemon) -> serde_json::Value {
    d.stats()["private_fallbacks"].clone()
}

/// Every reason a worker can report, forced once: `build_timeout` and `over_quota` by a real
/// acquire and publication, `daemon_away` by a worker that started before packd and
/// reported once it could, the others by a worker's report (where they arise for real:
/// publish.rs, xnnpack_ops.rs, llama.rs, the XNNPACK cache tests). Each shows in GetStats,
/// in ListClients with its reason, and in the metrics.
#[test]
fn every_fallback_reason_shows_in_stats_clients_and_metrics() {
    let port = free_port();
    let dir = std::sync::Arc::new(tempfile::tempdir().expect("tempdir"));
    let cfg = dir.path().join("packd.toml");
    std::fs::write(&cfg, "[limits]\nmax_builds_per_connection = 1\nmax_publish_bytes = 4096\n").expect("config");
    // A worker that finds packd away: it keeps its report and sends it once packd is there.
    let mut away = Command::new(env!("CARGO_BIN_EXE_publisher"));
    away.arg(dir.path())
        .args(["--report-only", "xnnpack", "away-model", "daemon_away", "1000", "--hold", "60"])
        .stdout(Stdio::piped());
    let mut away = away.spawn().expect("spawn");
    assert_eq!(first_line(&mut away)["got"], "waiting");
    let addr = format!("127.0.0.1:{port}");
    let d = Daemon::start_in(dir, &[], &["--config", cfg.to_str().expect("utf-8"), "--metrics-listen", &addr]);
    let mut held = Held(vec![away]);
    assert_eq!(first_line(&mut held.0[0])["got"], "reported");

    // build_timeout: a builder that never publishes, and a worker that waits 1 s for it.
    let mut hang = publisher(&d, &["slow", "--hang"]).spawn().expect("spawn");
    assert_eq!(first_line(&mut hang)["got"], "building");
    held.0.push(hang);
    let mut waiter =
        publisher(&d, &["slow", "--wait-seconds", "1", "--report", "--hold", "60"]).spawn().expect("spawn");
    let v = first_line(&mut waiter);
    assert_eq!((v["got"].as_str(), v["fallback"].as_str()), (Some("private"), Some("build_timeout")), "{v}");
    held.0.push(waiter);
    // publish_refused is ALREADY_EXISTS; over_quota a publication over max_publish_bytes.
    let mut big = publisher(&d, &["big", "--entries", "64", "--report", "--hold", "60"]).spawn().expect("spawn");
    let v = first_line(&mut big);
    assert_eq!((v["got"].as_str(), v["fallback"].as_str()), (Some("error"), Some("over_quota")), "{v}");
    held.0.push(big);
    // The others as an engine reports them.
    let reported = [
        "other",
        "unknown_interface",
        "unnamed_weights",
        "builder_gave_up",
        "build_limit",
        "publish_refused",
        "engine_cache",
        "asked",
        "worker_error",
        "unshared_buffer_type",
    ];
    for reason in reported {
        let mut c = publisher(&d, &["--report-only", "engine", &format!("m-{reason}"), reason, "4096", "--hold", "60"])
            .spawn()
            .expect("spawn");
        assert_eq!(first_line(&mut c)["got"], "reported");
        held.0.push(c);
    }
    let all: Vec<&str> = reported.into_iter().chain(["daemon_away", "over_quota", "build_timeout"]).collect();
    // Reports are sent at once and counted as they arrive (no batching, no timer): waited
    // for as an event, not timed.
    assert!(
        wait_until(Duration::from_secs(20), || {
            let f = fallbacks(&d);
            all.iter().all(|r| f[*r] == 1)
        }),
        "every reason counted: {}",
        fallbacks(&d)
    );
    let s = d.stats();
    assert_eq!(s["workers_private"], 13, "{s}");
    assert_eq!(s["private_reports"], 13, "{s}");
    // 1000 (away) + 4096 (the waiter's) + 64 × 128 rounded (big: 8192) + 10 × 4096.
    assert_eq!(s["private_bytes"], 1000 + 4096 + 8192 + 10 * 4096, "{s}");

    let out = d.packctl(&["clients", "--json"]);
    let clients: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let reasons: Vec<String> = clients["clients"]
        .as_array()
        .expect("clients")
        .iter()
        .flat_map(|c| c["reports"].as_array().cloned().unwrap_or_default())
        .filter(|r| r["obtained"] == "private")
        .map(|r| r["fallback"].as_str().expect("fallback").to_string())
        .collect();
    for r in &all {
        assert!(reasons.iter().any(|x| x == r), "{r} not in ListClients: {reasons:?}");
    }
    let text = String::from_utf8_lossy(&d.packctl(&["clients"]).stdout).to_string();
    assert!(text.contains("private build_timeout (publisher slow"), "{text}");

    let (status, body) = http_get(port, "/metrics");
    assert!(status.contains("200"), "{status}");
    for r in &all {
        let series = format!("packd_private_fallbacks_total{{reason=\"{r}\"}}");
        assert_eq!(sample(&body, &series), Some(1.0), "{series} in\n{body}");
    }
    assert_eq!(sample(&body, "packd_workers{state=\"private\"}"), Some(13.0));
    assert_eq!(sample(&body, "packd_requests_total{op=\"acquire\",code=\"private\"}"), Some(1.0), "{body}");
    assert!(body.ends_with("# EOF\n"), "not OpenMetrics: {body}");
    let (status, _) = http_get(port, "/other");
    assert!(status.contains("404"), "{status}");

    // A worker that says the same again (after a reconnect, or with its bytes) is not a
    // second fallback; one whose connection closes leaves the live figures.
    drop(held);
    assert!(wait_until(Duration::from_secs(5), || d.stat("clients") == 0), "workers gone");
    let s = d.stats();
    assert_eq!((s["workers_private"].as_u64(), s["private_bytes"].as_u64()), (Some(0), Some(0)), "{s}");
    assert_eq!(fallbacks(&d)["build_timeout"], 1);
}

/// N workers share one published model: the metrics say what they map and save, per model
/// and in all, and the reports say each was served (one built it).
#[test]
fn metrics_show_bytes_saved_by_workers() {
    let port = free_port();
    let d = Daemon::start_args(&[], &["--metrics-listen", &format!("127.0.0.1:{port}")]);
    let mut held = Held(Vec::new());
    for _ in 0..4 {
        let mut c =
            publisher(&d, &["shared-model", "--entries", "20", "--report", "--hold", "60"]).spawn().expect("spawn");
        let v = first_line(&mut c);
        assert!(v["got"] == "built" || v["got"] == "segment", "{v}");
        held.0.push(c);
    }
    // 20 entries × 128 bytes: one page.
    let size = 4096.0;
    assert!(wait_until(Duration::from_secs(5), || d.stat("leases") == 4), "4 workers served");
    let (_, body) = http_get(port, "/metrics");
    assert_eq!(sample(&body, "packd_mapped_bytes"), Some(4.0 * size), "{body}");
    assert_eq!(sample(&body, "packd_saved_bytes"), Some(3.0 * size), "{body}");
    let series = "packd_model_saved_bytes{model=\"shared-model\",label=\"shared-model\"}";
    assert_eq!(sample(&body, series), Some(3.0 * size), "{body}");
    let series = "packd_model_workers{model=\"shared-model\",label=\"shared-model\",state=\"served\"}";
    assert_eq!(sample(&body, series), Some(4.0), "{body}");
    let out = d.packctl(&["models", "--json"]);
    let m: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(m["models"][0]["bytes_saved"], 3 * 4096, "{m}");
    let out = d.packctl(&["clients", "--json"]);
    let c: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let how: Vec<&str> =
        c["clients"].as_array().expect("clients").iter().filter_map(|c| c["reports"][0]["obtained"].as_str()).collect();
    assert_eq!((how.iter().filter(|h| **h == "built").count(), how.len()), (1, 4), "{how:?}");
    drop(held);
}

/// A real Prometheus (Debian's `prometheus`) scrapes packd and answers a query for the bytes
/// saved by N workers.
#[test]
#[ignore = "needs Debian's prometheus (apt-get install prometheus; .ci/run installs it and runs this)"]
fn prometheus_scrapes_packd() {
    let prometheus = std::env::var("PACKD_PROMETHEUS").unwrap_or_else(|_| "prometheus".into());
    let port = free_port();
    let d = Daemon::start_args(&[], &["--metrics-listen", &format!("127.0.0.1:{port}")]);
    let mut held = Held(Vec::new());
    for _ in 0..3 {
        let mut c =
            publisher(&d, &["scraped-model", "--entries", "20", "--report", "--hold", "120"]).spawn().expect("spawn");
        first_line(&mut c);
        held.0.push(c);
    }
    assert!(wait_until(Duration::from_secs(5), || d.stat("leases") == 3), "3 workers served");
    let work = tempfile::tempdir().expect("tempdir");
    let config = work.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: packd\n    static_configs:\n      \
             - targets: ['127.0.0.1:{port}']\n"
        ),
    )
    .expect("config");
    let web = free_port();
    let mut prom = Command::new(&prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", work.path().join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{web}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(work.path().join("prometheus.log")).expect("log"))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {prometheus}: {e} (apt-get install prometheus)"));
    let query = |q: &str| -> Option<serde_json::Value> {
        let s = TcpStream::connect(("127.0.0.1", web)).ok()?;
        let mut s = s;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(s, "GET /api/v1/query?query={q} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        let body = text.split_once("\r\n\r\n")?.1;
        // Chunked or not: the JSON object is between the first '{' and the last '}'.
        let json = &body[body.find('{')?..=body.rfind('}')?];
        serde_json::from_str(json).ok()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let saved = loop {
        let v = query("packd_saved_bytes");
        if let Some(x) = v.as_ref().and_then(|v| v["data"]["result"][0]["value"][1].as_str()).map(str::to_string) {
            break x;
        }
        assert!(Instant::now() < deadline, "Prometheus never had packd_saved_bytes: {v:?}\n{}", {
            let _ = prom.kill();
            std::fs::read_to_string(work.path().join("prometheus.log")).unwrap_or_default()
        });
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(saved, (2 * 4096).to_string());
    let v = query("sum(packd_model_workers%7Bstate%3D%22served%22%7D)").expect("query");
    assert_eq!(v["data"]["result"][0]["value"][1], "3", "{v}");
    let v = query("up%7Bjob%3D%22packd%22%7D").expect("query");
    assert_eq!(v["data"]["result"][0]["value"][1], "1", "{v}");
    let _ = prom.kill();
    let _ = prom.wait();
    drop(held);
}

/// `packctl top` in a real terminal (tmux): shows the totals, the workers and one forced
/// private fallback with its reason; `s` changes the sort; `q` quits.
#[test]
#[ignore = "needs tmux (apt-get install tmux; .ci/run installs it and runs this)"]
fn packctl_top_in_tmux() {
    let d = Daemon::start();
    let mut held = Held(Vec::new());
    let mut c = publisher(&d, &["top-model", "--report", "--hold", "60"]).spawn().expect("spawn");
    first_line(&mut c);
    held.0.push(c);
    let mut c =
        publisher(&d, &["--report-only", "xnnpack", "forced-model", "unknown_interface", "5000", "--hold", "60"])
            .spawn()
            .expect("spawn");
    first_line(&mut c);
    held.0.push(c);
    let session = format!("packd-top-{}", std::process::id());
    let tmux = |args: &[&str]| Command::new("tmux").args(args).output().expect("tmux (apt-get install tmux)");
    let cmd = format!(
        "{} --socket-dir {} top --interval 0.2; echo top-exited-$?; sleep 30",
        packd_tests::packctl_bin().display(),
        d.dir().display()
    );
    let out = tmux(&["new-session", "-d", "-s", &session, "-x", "120", "-y", "30", &cmd]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let capture = || String::from_utf8_lossy(&tmux(&["capture-pane", "-p", "-t", &session]).stdout).to_string();
    // The screen once it shows what `wants` looks for (within 10 s), or the last one seen.
    let screen_with = |wants: &dyn Fn(&str) -> bool| {
        let mut screen = String::new();
        let seen = wait_until(Duration::from_secs(10), || {
            screen = capture();
            wants(&screen)
        });
        (seen, screen)
    };
    let (shown, screen) = screen_with(&|s| {
        s.contains("private unknown_interface (xnnpack forced-model")
            && s.contains("built (publisher top-model")
            && s.contains("private fallbacks: unknown_interface 1")
            && s.contains("served 1  building 0  private 1")
    });
    assert!(shown, "packctl top showed:\n{screen}");
    tmux(&["send-keys", "-t", &session, "s"]);
    let (sorted, screen) = screen_with(&|s| s.contains("sorted by saved"));
    assert!(sorted, "after s:\n{screen}");
    tmux(&["send-keys", "-t", &session, "q"]);
    let (quit, screen) = screen_with(&|s| s.contains("top-exited-0"));
    tmux(&["kill-session", "-t", &session]);
    assert!(quit, "after q:\n{screen}");
    drop(held);
}

/// The example Grafana dashboard asks only for metrics packd serves.
#[test]
fn the_grafana_dashboard_uses_only_served_metrics() {
    let port = free_port();
    let d = Daemon::start_args(&[], &["--metrics-listen", &format!("127.0.0.1:{port}")]);
    // One request, so that the request histograms have a series.
    assert!(d.client().get("b3:00").is_err());
    let (_, body) = http_get(port, "/metrics");
    // Samples, and families declared without samples yet (per-model gauges with no model).
    let served: std::collections::BTreeSet<&str> = body
        .lines()
        .filter_map(|l| match l.strip_prefix("# TYPE ") {
            Some(t) => t.split(' ').next(),
            None if l.starts_with('#') => None,
            None => l.split(['{', ' ']).next(),
        })
        .collect();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("deploy/grafana-packd.json")).expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let mut asked = 0;
    for panel in dash["panels"].as_array().expect("panels") {
        for t in panel["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr");
            for (i, _) in expr.match_indices("packd_") {
                let name: String = expr[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                assert!(served.contains(name.as_str()), "{}: {name} is not served", panel["title"]);
                asked += 1;
            }
        }
    }
    assert!(asked >= 12, "{asked}");
    drop(d);
}

/// A burst of reports (faster than the daemon reads them) costs neither the connection nor
/// the latest reports: what could not be written at once goes with the next call or, when
/// none comes, within seconds by itself.
#[test]
fn a_burst_of_reports_keeps_the_connection_and_the_latest_reports() {
    use packd_client::{Fallback, Report};
    let d = Daemon::start();
    let client = d.client();
    for i in 0..5000u64 {
        let fallback = if i % 2 == 0 { Fallback::OverQuota } else { Fallback::WorkerError };
        client.report(&Report::private("burst", &format!("m{}", i % 10), fallback, "burst", i));
    }
    // No call follows (a private worker computes on its own): the client's flusher sends
    // what the burst left unsent.
    let latest = |d: &Daemon| -> Vec<(String, u64)> {
        let out = d.packctl(&["clients", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let mut got: Vec<(String, u64)> = v["clients"][0]["reports"]
            .as_array()
            .map(|r| {
                r.iter()
                    .map(|r| {
                        (r["model"].as_str().unwrap_or_default().to_string(), r["private_bytes"].as_u64().unwrap_or(0))
                    })
                    .collect()
            })
            .unwrap_or_default();
        got.sort();
        got
    };
    let want: Vec<(String, u64)> = (0..10).map(|m| (format!("m{m}"), 4990 + m)).collect();
    assert!(wait_until(Duration::from_secs(20), || latest(&d) == want), "{:?}", latest(&d));
    assert_eq!(d.stat("clients"), 1, "the connection stayed");
    let out = d.packctl(&["clients", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let id = v["clients"][0]["id"].as_u64().expect("id");
    assert!(!d.log().contains(&format!("client disconnected client={id}")), "{}", d.log());
    drop(client);
}
