//! Tests of [`super`]: the files on disk after each commit, recovered as a crash leaves them.

use super::*;
use rusqlite::{params, Connection, OpenFlags};

fn writer(path: &std::path::Path) -> Connection {
    let vfs = register().unwrap();
    let c = Connection::open_with_flags_and_vfs(path, OpenFlags::default(), vfs).unwrap();
    c.pragma_update(None, "journal_mode", "WAL").unwrap();
    c.pragma_update(None, "synchronous", "NORMAL").unwrap();
    // Commits stay in the WAL, where a copy of the files must find them.
    c.pragma_update(None, "wal_autocheckpoint", 0).unwrap();
    c.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB NOT NULL)")
        .unwrap();
    c
}

/// What a process that died now would leave: the database and its WAL as the OS has them
/// (no checkpoint, no shared memory), opened by the plain VFS, which recovers from the WAL.
fn after_a_crash(path: &std::path::Path) -> Connection {
    let dir = path.parent().unwrap().join("copy");
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("db");
    let _ = std::fs::remove_file(copy.with_extension("db-shm"));
    std::fs::copy(path, &copy).unwrap();
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let mut copy_wal = copy.as_os_str().to_owned();
    copy_wal.push("-wal");
    std::fs::copy(&wal, &copy_wal).unwrap();
    let c = Connection::open(&copy).unwrap();
    let ok: String = c
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(ok, "ok");
    c
}

fn rows(c: &Connection) -> Vec<(i64, usize)> {
    let mut s = c
        .prepare("SELECT id, length(v) FROM t ORDER BY id")
        .unwrap();
    s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

#[test]
fn every_commit_is_in_the_file_when_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    let w = writer(&path);
    let reader = Connection::open(&path).unwrap();
    let mut want = Vec::new();
    // Small commits, one of several frames, and one far over what is gathered at once.
    for (id, size) in [(1, 10), (2, 5_000), (3, 40_000), (4, 900_000), (5, 3)] {
        w.execute("INSERT INTO t VALUES (?1, zeroblob(?2))", params![id, size])
            .unwrap();
        want.push((id, size as usize));
        assert_eq!(rows(&reader), want, "a reader on the plain VFS");
        assert_eq!(rows(&after_a_crash(&path)), want, "the files on disk");
    }
}

#[test]
fn a_transaction_that_spills_or_rolls_back_leaves_the_log_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    let w = writer(&path);
    // A tiny page cache: a transaction writes frames before its commit (a spill), and
    // rewrites some of them in place.
    w.pragma_update(None, "cache_size", 4).unwrap();
    let big = |w: &Connection, from: i64| {
        for id in from..from + 200 {
            w.execute("INSERT INTO t VALUES (?1, zeroblob(3000))", [id])
                .unwrap();
        }
        w.execute("UPDATE t SET v = zeroblob(2000) WHERE id % 7 = 0", [])
            .unwrap();
    };
    w.execute("INSERT INTO t VALUES (1, zeroblob(10))", [])
        .unwrap();
    w.execute_batch("BEGIN").unwrap();
    big(&w, 1000);
    w.execute_batch("ROLLBACK").unwrap();
    // A commit of one frame, written where the rolled-back frames were.
    w.execute("UPDATE t SET v = zeroblob(5) WHERE id = 1", [])
        .unwrap();
    assert_eq!(rows(&after_a_crash(&path)), vec![(1, 5)]);
    w.execute("DELETE FROM t", []).unwrap();
    w.execute_batch("BEGIN").unwrap();
    big(&w, 1000);
    w.execute_batch("COMMIT").unwrap();
    let want = rows(&w);
    assert_eq!(want.len(), 200);
    assert_eq!(rows(&Connection::open(&path).unwrap()), want);
    assert_eq!(rows(&after_a_crash(&path)), want);
}

/// The VFS's own rule, without SQLite's choices in the way: once a commit frame (header
/// and page) is written, every byte written so far is in the file, wherever the header
/// landed relative to what was gathered.
#[test]
fn nothing_stays_gathered_after_a_commit_frame() {
    assert!(register().is_some());
    let dir = tempfile::tempdir().unwrap();
    // The unix VFS gives a WAL its database's mode: the database must exist.
    std::fs::write(dir.path().join("db"), b"").unwrap();
    let path = dir.path().join("db-wal");
    let cpath = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: our VFS's xOpen and methods, called as SQLite would, on memory of its size.
    unsafe {
        let vfs = ffi::sqlite3_vfs_find(NAME.as_ptr());
        assert!(!vfs.is_null());
        let mut mem = vec![0u64; ((*vfs).szOsFile as usize).div_ceil(8)];
        let file = mem.as_mut_ptr() as *mut ffi::sqlite3_file;
        let flags = ffi::SQLITE_OPEN_WAL | ffi::SQLITE_OPEN_READWRITE | ffi::SQLITE_OPEN_CREATE;
        let open = (*vfs).xOpen.unwrap();
        assert_eq!(
            open(vfs, cpath.as_ptr(), file, flags, std::ptr::null_mut()),
            0
        );
        let m = &*(*file).pMethods;
        let put = |bytes: &[u8], at: i64| {
            let rc = m.xWrite.unwrap()(
                file,
                bytes.as_ptr() as *const c_void,
                bytes.len() as c_int,
                at,
            );
            assert_eq!(rc, ffi::SQLITE_OK);
        };
        let header = |commit: u8| {
            let mut h = [0u8; FRAME_HEADER];
            h[7] = commit;
            h
        };
        // A frame gathered at 20,000, then a one-frame commit written lower down (a log
        // restarted over frames that were never committed).
        put(&header(0), 20_000);
        put(&[1u8; 4096], 20_024);
        put(&header(9), 100);
        put(&[2u8; 4096], 100 + 24);
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(&on_disk[100..124], &header(9)[..]);
        assert!(
            on_disk[124..124 + 4096].iter().all(|&b| b == 2),
            "the commit's page"
        );
        assert!(on_disk[20_024..24_120].iter().all(|&b| b == 1));
        // The usual shape: frames gathered, then the commit frame right after them.
        put(&header(0), 10_000);
        put(&[3u8; 4096], 10_024);
        put(&header(9), 14_120);
        put(&[4u8; 4096], 14_144);
        let on_disk = std::fs::read(&path).unwrap();
        assert!(on_disk[10_024..14_120].iter().all(|&b| b == 3));
        assert!(
            on_disk[14_144..18_240].iter().all(|&b| b == 4),
            "the commit's page"
        );
        assert_eq!(m.xClose.unwrap()(file), ffi::SQLITE_OK);
    }
}
