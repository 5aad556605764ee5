//! Paths the configuration names, relative ones taken from where prefixlb started: a daemon
//! runs from `/`, and parses its configuration again there at each reload.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The directory prefixlb started in, as it was at the first call: `main` makes that call
/// (through [`absolute`], on the configuration's path) before a daemon forks and moves to `/`.
fn start_dir() -> &'static Path {
    static START: OnceLock<PathBuf> = OnceLock::new();
    START.get_or_init(|| std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/")))
}

/// `path`, absolute as it is or taken from [`start_dir`].
pub fn absolute(path: &Path) -> PathBuf {
    start_dir().join(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    // That a daemon keeps finding them after its fork is tested on one: `tests/upgrade`.
    #[test]
    fn a_relative_path_is_taken_from_the_start_directory() {
        let start = std::env::current_dir().unwrap();
        assert_eq!(
            absolute(Path::new("conf/keys.yaml")),
            start.join("conf/keys.yaml")
        );
        assert_eq!(
            absolute(Path::new("/etc/keys.yaml")),
            Path::new("/etc/keys.yaml")
        );
    }
}
