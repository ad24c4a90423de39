//! A real browser for the console tests: Debian's chromium, driven over WebDriver by the
//! `fantoccini` crate through Debian's chromedriver.
//!
//! One chromedriver serves the whole test binary (started by the first test that asks, on a
//! thread that lives as long as the binary; it is killed when the binary exits, by
//! `PR_SET_PDEATHSIG`). Each scenario opens one browser session and keeps it across its
//! steps, and closes it whether the scenario passed or panicked ([`Browser::run`]).

use fantoccini::elements::Element;
use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const CHROMIUM: &str = "/usr/bin/chromium";

/// The shared chromedriver's URL, or `None` (loudly; a failure under `CI=true`) when chromium
/// or chromedriver is not installed.
fn driver() -> Option<&'static str> {
    static URL: OnceLock<Option<String>> = OnceLock::new();
    URL.get_or_init(|| {
        let have = |bin: &str| {
            super::common::installed(
                bin,
                Command::new(bin).arg("--version").stdout(Stdio::null()),
            )
        };
        if !have(CHROMEDRIVER) || !have(CHROMIUM) {
            return None;
        }
        let port = super::common::unused_addr().port();
        let log = screens_dir().join("chromedriver.log");
        std::thread::Builder::new()
            .name("chromedriver".into())
            .spawn(move || keep_chromedriver(port, log))
            .expect("spawn the chromedriver thread");
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "chromedriver did not listen within 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(format!("http://127.0.0.1:{port}"))
    })
    .as_deref()
}

/// Runs chromedriver on `port` until it exits: this thread is its parent, and the kernel
/// kills it when the thread ends, i.e. when the test binary exits.
fn keep_chromedriver(port: u16, log: PathBuf) {
    use std::os::unix::process::CommandExt;
    let log = std::fs::File::create(&log).expect("create chromedriver.log");
    let mut command = Command::new(CHROMEDRIVER);
    command
        .arg(format!("--port={port}"))
        .arg("--allowed-ips=127.0.0.1")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("clone the log file"))
        .stderr(log);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // Waiting keeps this thread, the parent the kernel watches, alive as long as chromedriver.
    let mut child = command.spawn().expect("spawn chromedriver");
    let _ = child.wait();
}

/// Where screenshots go: `target/console-screens/`.
pub fn screens_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/console-screens");
    std::fs::create_dir_all(&dir).expect("create target/console-screens");
    dir
}

/// One browser session, and the name its screenshots start with.
#[derive(Clone)]
pub struct Browser {
    pub client: Client,
    prefix: String,
}

impl Browser {
    /// Opens a headless chromium, runs `scenario` with it, and closes it, panicked or not;
    /// skips (loudly) without a browser.
    pub async fn run<F, Fut>(prefix: &str, scenario: F)
    where
        F: FnOnce(Browser) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let Some(url) = driver() else { return };
        let mut caps = serde_json::Map::new();
        let args = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--window-size=1280,1300",
        ];
        caps.insert(
            "goog:chromeOptions".into(),
            json!({"binary": CHROMIUM, "args": args}),
        );
        let client = ClientBuilder::new(HttpConnector::new())
            .capabilities(caps)
            .connect(url)
            .await
            .unwrap_or_else(|e| panic!("start chromium through {url}: {e}"));
        let browser = Browser {
            client: client.clone(),
            prefix: prefix.to_owned(),
        };
        let outcome = tokio::spawn(scenario(browser)).await;
        let _ = client.close().await;
        if let Err(e) = outcome {
            std::panic::resume_unwind(e.into_panic());
        }
    }

    pub async fn goto(&self, url: &str) {
        self.client
            .goto(url)
            .await
            .unwrap_or_else(|e| panic!("go to {url}: {e}"));
    }

    /// The path and query of the page shown.
    pub async fn at(&self) -> String {
        let url = self.client.current_url().await.expect("current url");
        match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_owned(),
        }
    }

    /// The first `css` on the page, waited for (up to 10 s) while a navigation completes.
    pub async fn find(&self, css: &str) -> Element {
        let found = self
            .client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(Locator::Css(css))
            .await;
        match found {
            Ok(e) => e,
            Err(e) => panic!("no {css} on {}: {e}", self.at().await),
        }
    }

    pub async fn find_all(&self, css: &str) -> Vec<Element> {
        self.client
            .find_all(Locator::Css(css))
            .await
            .expect("find_all")
    }

    /// The visible text of the first `css`.
    pub async fn text(&self, css: &str) -> String {
        self.find(css).await.text().await.expect("element text")
    }

    /// Clicks `css` (a submit button or a link) and waits until the page it leads to has
    /// loaded: a WebDriver click does not always wait for the navigation it starts, and an
    /// element looked up meanwhile could be the old page's.
    pub async fn navigate(&self, css: &str) {
        self.script("window.__leaving = true; return null;").await;
        self.click(css).await;
        let client = &self.client;
        super::common::eventually_within(Duration::from_secs(10), move || async move {
            // While the next document loads, a script may find no context: not there yet.
            let arrived = client
                .execute(
                    "return window.__leaving === undefined && document.readyState === 'complete';",
                    vec![],
                )
                .await;
            match arrived {
                Ok(Value::Bool(true)) => Ok(()),
                _ => Err(format!("clicking {css} led nowhere")),
            }
        })
        .await
    }

    /// Types `text` into the field `css` (emptied first).
    pub async fn type_into(&self, css: &str, text: &str) {
        let field = self.find(css).await;
        field.clear().await.expect("clear a field");
        field.send_keys(text).await.expect("type into a field");
    }

    pub async fn click(&self, css: &str) {
        self.find(css)
            .await
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    pub async fn script(&self, js: &str) -> Value {
        self.client
            .execute(js, vec![])
            .await
            .unwrap_or_else(|e| panic!("run {js}: {e}"))
    }

    /// Saves a screenshot as `target/console-screens/<prefix>-<name>.png`, after asserting
    /// that the page fits the window's width (1280 px): no long key, entity or note pushes it
    /// into a horizontal scroll.
    pub async fn screenshot(&self, name: &str) {
        let sizes = self
            .script("return [document.documentElement.scrollWidth, document.documentElement.clientWidth];")
            .await;
        let (wide, window) = (sizes[0].as_u64(), sizes[1].as_u64());
        assert!(
            wide <= window,
            "{name}: the page is {wide:?} px wide in a {window:?} px window"
        );
        let png = self.client.screenshot().await.expect("screenshot");
        let path = screens_dir().join(format!("{}-{name}.png", self.prefix));
        std::fs::write(&path, png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }

    /// Asserts that no hostile value ran or became markup on this page: the flag every payload
    /// sets is unset, the page has no `<script>` or `<img>` at all (the console has none of its
    /// own), and every link is a plain `http:` link (never `javascript:`).
    pub async fn assert_unharmed(&self) {
        let where_ = self.at().await;
        let verdict = self
            .script(
                "return {pwned: window.__pwned === undefined ? null : String(window.__pwned), \
                 scripts: document.querySelectorAll('script').length, \
                 imgs: document.querySelectorAll('img, iframe, object, embed').length, \
                 handlers: document.querySelectorAll('[onerror], [onload], [onclick]').length, \
                 links: Array.from(document.links).filter(a => a.protocol !== 'http:').map(a => a.href)};",
            )
            .await;
        assert_eq!(
            verdict,
            json!({"pwned": null, "scripts": 0, "imgs": 0, "handlers": 0, "links": []}),
            "a hostile value became markup on {where_}"
        );
    }
}
