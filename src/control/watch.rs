//! Files read again when they change: the peers file, the API keys, the listeners'
//! certificates. A file is read whole or not at all (see [`SettledFile`]); what it holds is
//! checked before it replaces anything, so a bad edit leaves the last good contents in force.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::error::Error;
use crate::metrics;
use crate::tenants::Tenants;
use crate::tls::CertStore;

/// How long a file changed in place must stay as it is before it is read as the new list: a
/// writer that does not write-then-rename is caught mid-write otherwise.
const SETTLE: Duration = Duration::from_millis(200);

/// A file whose contents are taken only once a writer is done with them.
pub struct SettledFile {
    path: PathBuf,
    /// What the file held when it was last read, so that an unchanged file is not parsed, and
    /// the inode it was read from.
    last: Option<(String, u64)>,
}

impl SettledFile {
    pub fn new(path: PathBuf) -> Self {
        Self { path, last: None }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's text and inode.
    async fn read(&self) -> Result<(String, u64), Error> {
        let path = self.path.clone();
        // The inode of the open file, not of the path: a rename between a stat of the path and
        // the read would pair the new file's text with the old inode, and the next in-place
        // write to the new file would pass for a rename, read whole however far it had got.
        let read = move || {
            let mut file = std::fs::File::open(&path)?;
            let inode = std::os::unix::fs::MetadataExt::ino(&file.metadata()?);
            let mut text = String::new();
            std::io::Read::read_to_string(&mut file, &mut text)?;
            Ok((text, inode))
        };
        let fail =
            |e: std::io::Error| Error::new("", format!("cannot read {}: {e}", self.path.display()));
        match tokio::task::spawn_blocking(read).await {
            Ok(read) => read.map_err(fail),
            Err(e) => Err(fail(std::io::Error::other(e))),
        }
    }

    /// The file's text when it changed since the last call (always, with `force`).
    pub async fn changed(&mut self, force: bool) -> Result<Option<String>, Error> {
        let read = self.read().await?;
        let in_place = match &self.last {
            Some((text, _)) if !force && *text == read.0 => return Ok(None),
            Some((_, inode)) => *inode == read.1,
            // The first read may meet a writer mid-write as well as any later one.
            None => true,
        };
        // A file put in place by a rename is whole; one rewritten in place (or met for the
        // first time) may still be growing.
        if in_place {
            tokio::time::sleep(SETTLE).await;
            if self.read().await?.0 != read.0 {
                log::debug!(
                    "{} is being written: read again at the next check",
                    self.path.display()
                );
                return Ok(None);
            }
        }
        let text = read.0.clone();
        self.last = Some(read);
        Ok(Some(text))
    }

    /// What the file held when it was last read.
    pub fn text(&self) -> Option<&str> {
        self.last.as_ref().map(|(text, _)| text.as_str())
    }

    /// Forgets what was read: the next check reads the file again, changed or not.
    pub fn forget(&mut self) {
        self.last = None;
    }

    /// Takes the file's text as read now, for contents already applied at start-up.
    pub fn mark_read(&mut self, text: String) {
        let inode = std::fs::metadata(&self.path)
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .unwrap_or(0);
        self.last = Some((text, inode));
    }
}

/// Something kept in step with files.
#[async_trait]
pub trait Watched: Send + Sync {
    /// What the files are, for the log.
    fn label(&self) -> String;
    /// What kind of file, as the metrics name it.
    fn kind(&self) -> &'static str;
    /// Reads the files again if they changed (or with `force`) and applies them; `Ok(false)`
    /// when nothing changed.
    async fn check(&mut self, force: bool) -> Result<bool, Error>;
}

/// The API keys file, applied to the tenants.
pub struct KeysFile {
    pub file: SettledFile,
    pub tenants: Arc<Tenants>,
}

#[async_trait]
impl Watched for KeysFile {
    fn kind(&self) -> &'static str {
        "api_keys"
    }

    fn label(&self) -> String {
        format!("API keys {}", self.file.path().display())
    }

    async fn check(&mut self, force: bool) -> Result<bool, Error> {
        let Some(text) = self.file.changed(force).await? else {
            return Ok(false);
        };
        let n = self.tenants.replace(&text)?;
        log::info!("{}: now {n} keys", self.label());
        Ok(true)
    }
}

/// A listener's certificate chain and key, applied to its store.
pub struct CertFiles {
    pub cert: SettledFile,
    pub key: SettledFile,
    pub store: Arc<CertStore>,
    /// Set while the files on disk are a pair that does not load: they are read again at
    /// every check until they do.
    pub refused: bool,
}

#[async_trait]
impl Watched for CertFiles {
    fn kind(&self) -> &'static str {
        "certificate"
    }

    fn label(&self) -> String {
        format!("certificate {}", self.cert.path().display())
    }

    async fn check(&mut self, force: bool) -> Result<bool, Error> {
        // Both are read every time, so that each knows its last text; when either cannot be
        // read, both are read again next time, so that a half taken now is not lost.
        let cert = self.cert.changed(force).await;
        let key = self.key.changed(force).await;
        let (cert, key) = match (cert, key) {
            (Ok(cert), Ok(key)) => (cert, key),
            (Err(e), _) | (_, Err(e)) => {
                self.cert.forget();
                self.key.forget();
                return Err(e);
            }
        };
        if cert.is_none() && key.is_none() {
            return Ok(false);
        }
        // A new chain with the old key (or the other way round) fails to load: the old pair
        // stays, and both are read again next time, until the other half is in place too. Only
        // a pair still refused at the next check is an error: a renewal that renames one file
        // and then the other is met between the two now and then.
        let (cert, key) = (self.cert.text(), self.key.text());
        let applied = self.store.replace(
            cert.unwrap_or_default().as_bytes(),
            key.unwrap_or_default().as_bytes(),
        );
        if let Err(e) = applied {
            self.cert.forget();
            self.key.forget();
            let again = std::mem::replace(&mut self.refused, true);
            if !again {
                log::debug!("{}: {e}; reading it again at the next check", self.label());
                return Ok(false);
            }
            return Err(e);
        }
        self.refused = false;
        log::info!("{}: new certificate in use", self.label());
        Ok(true)
    }
}

/// How often the watched files are looked at, besides SIGHUP.
const INTERVAL: Duration = Duration::from_secs(1);

/// The background service that keeps every [`Watched`] in step.
pub struct FileWatch {
    watched: tokio::sync::Mutex<Vec<Box<dyn Watched>>>,
}

impl FileWatch {
    pub fn new(watched: Vec<Box<dyn Watched>>) -> Self {
        Self {
            watched: tokio::sync::Mutex::new(watched),
        }
    }
}

#[async_trait]
impl BackgroundService for FileWatch {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut watched = self.watched.lock().await;
        let mut hangup =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let force = tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => false,
                Some(()) = async { match hangup.as_mut() { Some(h) => h.recv().await, None => None } } => true,
            };
            for w in watched.iter_mut() {
                let result = match w.check(force).await {
                    Ok(true) => "changed",
                    Ok(false) => continue,
                    Err(e) => {
                        log::error!("{} not reloaded, keeping the current one: {e}", w.label());
                        "error"
                    }
                };
                metrics::FILE_RELOADS
                    .with_label_values(&[w.kind(), result])
                    .inc();
            }
        }
    }
}
