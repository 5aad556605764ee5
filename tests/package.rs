//! The Debian package (`cargo deb`, from Cargo.toml's `[package.metadata.deb]`) agrees with the
//! tree: every asset it names exists (a `target/release/` one is a binary of this package), the
//! unit and the postinst cargo-deb looks for are there, and every program and file the systemd
//! unit names is one the package installs, run as the user the postinst creates, with the PID
//! file where the installed `pingora.yaml` writes it. `.ci/run` builds, installs and checks the
//! package itself; this catches the drift in `cargo test`.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// This package's entry in `cargo metadata`, which carries `[package.metadata]` as JSON.
fn package() -> Value {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--no-deps",
            "--offline",
            "--format-version",
            "1",
        ])
        .arg("--manifest-path")
        .arg(Path::new(ROOT).join("Cargo.toml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "prefixlb")
        .unwrap()
        .clone()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The unit's settings, comments left out: (key, value) in order.
fn unit() -> Vec<(String, String)> {
    read("systemd/prefixlb.service")
        .lines()
        .filter(|l| !l.starts_with(['#', ';']))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

fn setting(unit: &[(String, String)], key: &str) -> String {
    unit.iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("the unit has no {key}="))
        .1
        .clone()
}

#[test]
fn the_package_installs_what_the_unit_runs_and_reads() {
    let package = package();
    let deb = &package["metadata"]["deb"];
    let bins: BTreeSet<&str> = package["targets"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["kind"].as_array().unwrap().iter().any(|k| k == "bin"))
        .map(|t| t["name"].as_str().unwrap())
        .collect();

    // Every asset's source exists, and the paths it installs (a destination ending in `/` is a
    // directory that takes the source's name).
    let mut installed = BTreeSet::new();
    for asset in deb["assets"].as_array().expect("explicit assets") {
        let [source, dest, _mode] = &asset.as_array().unwrap()[..] else {
            panic!("an asset is [source, destination, mode]: {asset}");
        };
        let (source, dest) = (source.as_str().unwrap(), dest.as_str().unwrap());
        match source.strip_prefix("target/release/") {
            Some(bin) => assert!(bins.contains(bin), "{source} is not a binary of prefixlb"),
            None => assert!(
                Path::new(ROOT).join(source).is_file(),
                "{source} is missing"
            ),
        }
        let name = Path::new(source).file_name().unwrap().to_str().unwrap();
        let dest = match dest.strip_suffix('/') {
            Some(dir) => format!("/{dir}/{name}"),
            None => format!("/{dest}"),
        };
        installed.insert(dest);
    }
    for bin in &bins {
        assert!(
            installed.contains(&format!("/usr/bin/{bin}")),
            "{bin} is not packaged"
        );
    }

    // cargo-deb finds the unit as `<package>.service` in unit-scripts, and puts its snippets at
    // the postinst's #DEBHELPER#.
    let units = deb["systemd-units"]["unit-scripts"].as_str().unwrap();
    assert!(Path::new(ROOT)
        .join(units)
        .join("prefixlb.service")
        .is_file());
    let scripts = deb["maintainer-scripts"].as_str().unwrap();
    let postinst = read(&format!("{}/postinst", scripts.trim_end_matches('/')));
    assert!(postinst.contains("#DEBHELPER#"));

    // Every absolute path the unit runs or reads under /usr/bin or /etc/prefixlb is installed.
    let unit = unit();
    let mut named = 0;
    for (key, value) in &unit {
        for word in value.split_whitespace() {
            if word.starts_with("/usr/bin/") || word.starts_with("/etc/prefixlb/") {
                assert!(
                    installed.contains(word),
                    "{key}={value}: {word} is not packaged"
                );
                named += 1;
            }
        }
    }
    assert!(named >= 4, "the unit names {named} packaged paths");

    // Its user is the one the postinst creates; its PID file is where the installed
    // pingora.yaml writes it, in the unit's RuntimeDirectory.
    let user = setting(&unit, "User");
    assert!(
        postinst
            .lines()
            .any(|l| l.contains("adduser --system --group") && l.ends_with(&format!(" {user}"))),
        "the postinst does not create {user}"
    );
    assert_eq!(setting(&unit, "Group"), user);
    let pid_file = setting(&unit, "PIDFile");
    let runtime = format!("/run/{}/", setting(&unit, "RuntimeDirectory"));
    assert!(
        pid_file.starts_with(&runtime),
        "{pid_file} is not in {runtime}"
    );
    let pingora = read("systemd/pingora.yaml");
    assert!(
        pingora.contains(&format!("pid_file: {pid_file}\n")),
        "systemd/pingora.yaml does not write {pid_file}"
    );
    assert!(pingora.contains(&format!("upgrade_sock: {runtime}")));
}
