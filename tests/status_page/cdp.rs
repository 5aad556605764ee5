//! Headless Chromium for the tests: its command line (a page's DOM and a screenshot), and the
//! DevTools protocol over `--remote-debugging-pipe` (JSON messages ended by NUL on fds 3 and 4)
//! for what a command line cannot do, a click. A pipe needs no WebSocket client and no
//! chromedriver whose version must match the browser's.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The browser, or `None` when the test may skip: none is installed and
/// `PREFIXLB_SKIP_BROWSER=1` says that is expected. Without that variable a missing browser
/// fails the test, so that CI (which installs it) cannot pass by skipping.
pub fn browser() -> Option<PathBuf> {
    let found = ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| {
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
                .map(|dir| dir.join(name))
                .find(|p| p.is_file())
        });
    if found.is_none() {
        let skip = std::env::var("PREFIXLB_SKIP_BROWSER").is_ok_and(|v| v == "1");
        assert!(
            skip,
            "no chromium on PATH: install it (apt-get install chromium; .ci/run does) or set \
             PREFIXLB_SKIP_BROWSER=1 to skip the browser tests"
        );
        eprintln!("skipped: no chromium on PATH and PREFIXLB_SKIP_BROWSER=1");
    }
    found
}

/// Flags every run takes: no sandbox (tests may run as root, in containers), no GPU, `/tmp`
/// rather than a small `/dev/shm`, and a profile of its own so that runs in parallel do not
/// share one.
fn base_args(profile: &Path) -> Vec<String> {
    vec![
        "--headless=new".into(),
        "--no-sandbox".into(),
        "--disable-gpu".into(),
        "--disable-dev-shm-usage".into(),
        "--no-first-run".into(),
        "--no-default-browser-check".into(),
        format!("--user-data-dir={}", profile.display()),
    ]
}

/// Waits for `child` at most `limit`, killing it then.
async fn finish(mut child: Child, limit: Duration, what: &str) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{what}: chromium exited with {status}");
            return;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: chromium still running after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The DOM of `url` once its scripts have run for `budget_ms` of virtual time (time stands
/// still while requests are out, so a page that refreshes itself gets its answers).
pub async fn dump_dom(chromium: &Path, url: &str, budget_ms: u32) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("dom.html");
    let child = Command::new(chromium)
        .args(base_args(&dir.path().join("profile")))
        .arg(format!("--virtual-time-budget={budget_ms}"))
        .arg("--dump-dom")
        .arg(url)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    finish(child, Duration::from_secs(60), "dump-dom").await;
    std::fs::read_to_string(&out).unwrap()
}

/// A `width` x `height` screenshot of `url` into `png`, after `budget_ms` of virtual time.
pub async fn screenshot(chromium: &Path, url: &str, budget_ms: u32, png: &Path, size: (u32, u32)) {
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new(chromium)
        .args(base_args(&dir.path().join("profile")))
        .arg(format!("--virtual-time-budget={budget_ms}"))
        .arg(format!("--window-size={},{}", size.0, size.1))
        .arg("--hide-scrollbars")
        .arg(format!("--screenshot={}", png.display()))
        .arg(url)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    finish(child, Duration::from_secs(60), "screenshot").await;
}

/// One browser driven over the DevTools pipe, with one page attached; killed when dropped.
pub struct Browser {
    child: Child,
    to: std::io::PipeWriter,
    from: tokio::sync::mpsc::UnboundedReceiver<Value>,
    session: String,
    next_id: u64,
    _profile: tempfile::TempDir,
}

impl Browser {
    pub async fn launch(chromium: &Path) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let (commands_r, commands_w) = std::io::pipe().unwrap();
        let (events_r, events_w) = std::io::pipe().unwrap();
        let (theirs_in, theirs_out) = (commands_r.as_raw_fd(), events_w.as_raw_fd());
        let mut command = Command::new(chromium);
        command
            .args(base_args(&profile.path().join("profile")))
            .arg("--remote-debugging-pipe")
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only fcntl and dup2 run between fork and exec, both async-signal-safe.
        unsafe {
            command.pre_exec(move || {
                // Copied above 4 first: either end may itself be fd 3 or 4, and a dup2 onto
                // itself would keep the close-on-exec flag.
                let a = libc::fcntl(theirs_in, libc::F_DUPFD, 10);
                let b = libc::fcntl(theirs_out, libc::F_DUPFD, 10);
                if a < 0 || b < 0 || libc::dup2(a, 3) < 0 || libc::dup2(b, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().unwrap();
        drop((commands_r, events_w));
        let (tx, from) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(events_r);
            let mut message = Vec::new();
            while reader.read_until(0, &mut message).is_ok_and(|n| n > 0) {
                if message.last() == Some(&0) {
                    message.pop();
                }
                if let Ok(v) = serde_json::from_slice::<Value>(&message) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
                message.clear();
            }
        });
        let mut browser = Browser {
            child,
            to: commands_w,
            from,
            session: String::new(),
            next_id: 0,
            _profile: profile,
        };
        let target = browser
            .call(None, "Target.createTarget", json!({"url": "about:blank"}))
            .await
            .unwrap();
        let attached = browser
            .call(
                None,
                "Target.attachToTarget",
                json!({"targetId": target["targetId"], "flatten": true}),
            )
            .await
            .unwrap();
        browser.session = attached["sessionId"].as_str().unwrap().to_owned();
        browser
    }

    /// Sends `method` (to the page when `session` is set, else to the browser) and returns its
    /// result, or its error; events that arrive meanwhile are dropped.
    async fn call(
        &mut self,
        session: Option<&str>,
        method: &str,
        params: Value,
    ) -> Result<Value, Value> {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            message["sessionId"] = json!(s);
        }
        let mut bytes = serde_json::to_vec(&message).unwrap();
        bytes.push(0);
        self.to.write_all(&bytes).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let reply = tokio::time::timeout_at(deadline, self.from.recv())
                .await
                .unwrap_or_else(|_| panic!("no answer to {method} in 30 s"))
                .unwrap_or_else(|| panic!("chromium closed its pipe during {method}"));
            if reply["id"] == id {
                return match reply["error"].is_null() {
                    true => Ok(reply["result"].clone()),
                    false => Err(reply["error"].clone()),
                };
            }
        }
    }

    async fn page_call(&mut self, method: &str, params: Value) -> Result<Value, Value> {
        let session = self.session.clone();
        self.call(Some(&session), method, params).await
    }

    pub async fn navigate(&mut self, url: &str) {
        let r = self
            .page_call("Page.navigate", json!({"url": url}))
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(r["errorText"].is_null(), "{url}: {}", r["errorText"]);
    }

    /// The value of `expression` in the page (awaited when it is a promise), or what went
    /// wrong. DevTools evaluation is not bound by the page's content security policy.
    async fn try_eval(&mut self, expression: &str) -> Result<Value, Value> {
        let params = json!({"expression": expression, "awaitPromise": true, "returnByValue": true});
        let r = self.page_call("Runtime.evaluate", params).await?;
        match r["exceptionDetails"].is_null() {
            true => Ok(r["result"]["value"].clone()),
            false => Err(r["exceptionDetails"].clone()),
        }
    }

    pub async fn eval(&mut self, expression: &str) -> Value {
        self.try_eval(expression)
            .await
            .unwrap_or_else(|e| panic!("{expression}: {e}"))
    }

    /// Evaluates `expression` until it is `true`, at most `limit`; a page still loading may
    /// not evaluate it yet.
    pub async fn wait_for(&mut self, expression: &str, limit: Duration) {
        let start = Instant::now();
        while self.try_eval(expression).await != Ok(json!(true)) {
            assert!(
                start.elapsed() < limit,
                "not true after {limit:?}: {expression}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
