//! prefixlb's own configuration: one YAML file in, [`Settings`] out. Pingora's server settings
//! stay in Pingora's file (`-c`).
//!
//! `migrate` moves the keys of older files to their places, `schema` is the file as users
//! write it, `convert` checks it and turns it into settings. Every error names the field and
//! the reason: unknown keys, wrong types and bad values alike. `docs/configuration.md` is the
//! reference.

mod convert;
mod error;
pub mod migrate;
pub mod paths;
pub mod schema;

use std::path::Path;

use serde::Deserializer;

use self::migrate::Move;
use crate::routing::PeerSpec;
use crate::settings::Settings;
pub use error::ConfigError;

/// Reads `T` from YAML, naming the field of any error.
fn read<'de, T, D>(de: D) -> Result<T, ConfigError>
where
    T: serde::Deserialize<'de>,
    D: Deserializer<'de>,
    D::Error: std::fmt::Display,
{
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = match e.path().to_string() {
            root if root == "." => String::new(),
            path => path,
        };
        // serde_yaml starts its message with the path of the enclosing value; the field
        // already says it.
        let message = e.into_inner().to_string();
        let reason = match message.split_once(": ") {
            Some((prefix, rest)) if !field.is_empty() && field.starts_with(prefix) => {
                rest.to_owned()
            }
            _ => message,
        };
        ConfigError::new(field, reason)
    })
}

fn from_yaml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, ConfigError> {
    read(serde_yaml::Deserializer::from_str(text))
}

/// Reads and checks prefixlb's file; also says which of its keys have moved.
pub fn load(path: &Path) -> Result<(Settings, Vec<&'static Move>), ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new("", format!("cannot read {}: {e}", path.display())))?;
    parse_renamed(&text)
}

/// Checks prefixlb's file, given as text.
pub fn parse(text: &str) -> Result<Settings, ConfigError> {
    parse_renamed(text).map(|(settings, _)| settings)
}

/// [`parse`], and the keys of the file that are now called otherwise.
pub fn parse_renamed(text: &str) -> Result<(Settings, Vec<&'static Move>), ConfigError> {
    let mut doc: serde_yaml::Value = from_yaml(text)?;
    let renamed = migrate::migrate(&mut doc)?;
    // A file of current keys is read from its text, so that errors keep their line.
    let file = match renamed.is_empty() {
        true => from_yaml::<schema::File>(text),
        false => read(doc),
    };
    let settings = file
        .and_then(schema::File::into_settings)
        .map_err(|e| migrate::name_old(e, &renamed))?;
    Ok((settings, renamed))
}

/// The peers of a peers file: `peers: [...]`, in the same form as the main file's.
pub fn parse_peers_file(text: &str) -> Result<Vec<PeerSpec>, ConfigError> {
    convert::peers(&from_yaml::<schema::peers::PeersFile>(text)?.peers)
}

#[cfg(test)]
mod tests;
