//! Peers listed in a file: a peers file of its own, or the `peers` section of prefixlb's own
//! configuration file. A file is taken only once a writer is done with it
//! ([`SettledFile`]), and parsed only when it changed.

use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;

use super::source::{AtStart, PeerSource};
use crate::config;
use crate::control::watch::SettledFile;
use crate::error::Error;
use crate::routing::PeerSpec;

pub struct FileSource {
    file: SettledFile,
    interval: Duration,
    /// The file is prefixlb's whole configuration, not a list of peers alone.
    whole_config: bool,
    /// What the file's text failed with at its last parse. That text is parsed again at each
    /// check (a name in it may resolve later, a file it names may appear), and the same
    /// failure is said again only when asked to (SIGHUP).
    failed: Option<String>,
}

impl FileSource {
    /// A peers file of its own.
    pub fn peers_file(path: &Path, interval: Duration) -> Self {
        // Relative to where prefixlb started, not to / where a daemon runs; through symlinks
        // at each read, as a ConfigMap's update repoints them.
        let path = config::paths::absolute(path);
        Self {
            file: SettledFile::new(path),
            interval,
            whole_config: false,
            failed: None,
        }
    }

    /// The `peers` section of prefixlb's own file.
    pub fn config_file(path: &Path, interval: Duration) -> Self {
        Self {
            file: SettledFile::new(path.to_owned()),
            interval,
            whole_config: true,
            failed: None,
        }
    }
}

#[async_trait]
impl PeerSource for FileSource {
    fn label(&self) -> String {
        self.file.path().display().to_string()
    }

    fn interval(&self) -> Duration {
        self.interval
    }

    fn at_start(&self) -> AtStart {
        // The configuration's own peers were read with it; they are parsed again at the first
        // tick, so that an edit made since start-up is not lost.
        if self.whole_config {
            AtStart::Loaded
        } else {
            AtStart::Required
        }
    }

    async fn peers(&mut self, force: bool) -> Result<Option<Vec<PeerSpec>>, Error> {
        let Some(text) = self.file.changed(force).await? else {
            return Ok(None);
        };
        let whole_config = self.whole_config;
        // Peer hostnames resolve through the system's blocking resolver: off the runtime.
        let parsed = tokio::task::spawn_blocking(move || {
            if whole_config {
                config::parse(&text).map(|s| s.peers)
            } else {
                config::parse_peers_file(&text)
            }
        })
        .await
        .map_err(|e| Error::new("", format!("reading the peers failed: {e}")))?;
        match parsed {
            Ok(specs) => {
                self.failed = None;
                Ok(Some(specs))
            }
            Err(e) => {
                self.file.forget();
                let said = e.to_string();
                if !force && self.failed.as_deref() == Some(said.as_str()) {
                    log::debug!("{}: still {said}", self.file.path().display());
                    return Ok(None);
                }
                self.failed = Some(said);
                Err(e.into())
            }
        }
    }
}
