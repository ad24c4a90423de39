//! Store faults on SQLite: a database whose disk is full fails closed (503, nothing
//! forwarded, `/readyz` failing) and recovers by itself once space is back.

mod common;

use common::*;
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A small tmpfs mounted for the test (root only), unmounted on drop.
struct SmallDisk {
    path: PathBuf,
}

impl SmallDisk {
    fn mount(dir: &Path) -> Option<SmallDisk> {
        let path = dir.join("disk");
        std::fs::create_dir_all(&path).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=2M", "tmpfs"])
            .arg(&path)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let msg = "SQLite disk-full test SKIPPED: cannot mount a tmpfs here (needs root)";
            skip_loudly(msg);
            return None;
        }
        Some(SmallDisk { path })
    }

    /// Writes a filler file until the disk is full.
    fn fill(&self) {
        let mut f = std::fs::File::create(self.path.join("filler")).unwrap();
        let chunk = vec![0u8; 64 * 1024];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.write_all(&chunk[..1]);
        let _ = f.sync_all();
    }

    fn free(&self) {
        std::fs::remove_file(self.path.join("filler")).unwrap();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_sqlite_disk_fails_closed_and_recovers() {
    let dir = TestDir::new();
    let Some(disk) = SmallDisk::mount(dir.path()) else {
        return;
    };
    let upstream = RecordingUpstream::start().await;
    let toml = format!(
        "{}\n[store]\nurl = \"sqlite://{}/idemproxy.db\"\n\n[upstreams.api]\nurl = \"{}\"\nprefix = \"/api\"\n",
        server_section(),
        disk.path.display(),
        upstream.url()
    );
    let proxy = TestProxy::start_in(dir, &toml).await;
    let post = |key: &'static str| {
        let url = proxy.url("/api/orders");
        async move {
            post_json(
                &url,
                Some(key),
                &json!({"order": key, "pad": "x".repeat(2000)}),
                &[],
            )
            .await
        }
    };
    post("before").await.assert_status(200);
    assert_eq!(upstream.count(), 1);
    // Its answer came before its completion committed: an operator's read waits for it.
    let shown = get(&proxy.admin_url("/admin/keys/before")).await;
    assert_eq!(shown.json()["records"][0]["state"], "completed");

    disk.fill();
    for key in ["full-1", "full-2", "full-3"] {
        let r = post(key).await;
        r.assert_status(503);
        assert_eq!(r.error_type(), Some("store_unavailable"), "{key}");
    }
    assert_eq!(
        upstream.count(),
        1,
        "nothing is forwarded when the reservation cannot be stored"
    );
    get(&proxy.admin_url("/readyz")).await.assert_status(503);
    // Stored answers still replay: reads need no space.
    assert_eq!(post("before").await.replayed(), Some(true));

    disk.free();
    eventually(|| async {
        match get(&proxy.admin_url("/readyz")).await.status {
            200 => Ok(()),
            _ => Err("the store did not recover after space came back".to_owned()),
        }
    })
    .await;
    post("after").await.assert_status(200);
    assert_eq!(upstream.count(), 2);
    assert_eq!(post("after").await.replayed(), Some(true));
    assert_eq!(upstream.count(), 2);
}
