//! The shared-memory segment: one file that every rank maps (`/dev/shm/...` or a file-backed
//! fallback). Everything that touches the OS or the raw mapping lives here, so this is where the
//! crate's `unsafe` is.
//!
//! Layout (byte offsets into the mapping; `W` = world size, `L` = lane bytes, a multiple of 64):
//! ```text
//! 0                    global header (128 B): magic, version, world_size, lane_bytes
//! 128 + 256·r          rank r's slot (256 B = four cache lines, so ranks never share a line):
//!                        line 0: arrive   barrier epoch, polled by every peer
//!                        line 1: pid, departed
//!                        line 2: meta[0]  (op, seq, len, root) of the collective using parity 0
//!                        line 3: meta[1]  same for parity 1
//! D = align4k(128+256·W)
//! D + (2r + p)·L        lane[r][p]: rank r's input for rounds of parity p
//! D + (2W + p)·L        result[p]: reduce-scatter output of rounds of parity p
//! D + (2W + 2)·L        end
//! ```
//! Rank 0 builds the file under a temporary name, writes the header and its own pid, publishes the
//! magic word (Release) and renames it into place, so a reader sees either no file, a stale one, or a
//! complete header. Stale files (their rank 0 is gone or departed) are ignored by [`Segment::try_open`].

use std::fs::{File, OpenOptions};
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapMut, MmapOptions};

use crate::error::{CommError, Result};

const MAGIC: u64 = u64::from_le_bytes(*b"v41comm\0");
const VERSION: u64 = 1;
const GLOBAL_BYTES: usize = 128;
const SLOT_BYTES: usize = 256;
const PAGE: usize = 4096;
/// Lanes and results start at multiples of this, and their size must be one.
pub const LANE_ALIGN: usize = 64;
/// Largest supported world size.
pub const MAX_WORLD_SIZE: usize = 256;
/// Largest supported lane size (1 GiB).
pub const MAX_LANE_BYTES: usize = 1 << 30;

// Word indices (u64) inside the global header and inside a rank slot.
const G_MAGIC: usize = 0;
const G_VERSION: usize = 1;
const G_WORLD: usize = 2;
const G_LANE: usize = 3;
const S_ARRIVE: usize = 0;
const S_PID: usize = 8;
const S_DEPARTED: usize = 9;
const S_META: usize = 16; // meta[p] = words S_META + 8p .. S_META + 8p + 4

/// What a rank announces about the collective it is in, checked by every peer after the first
/// barrier of the collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meta {
    pub op: u64,
    pub seq: u64,
    pub len: u64,
    pub root: u64,
}

/// Element types that may be viewed in lanes: plain data, every bit pattern valid, alignment ≤ 64.
///
/// # Safety
/// Implement only for such types.
pub unsafe trait Elem: Copy + Send + Sync + 'static {}
// SAFETY: integers and floats: any bit pattern is a value, alignment ≤ 8.
unsafe impl Elem for u8 {}
unsafe impl Elem for u16 {}
unsafe impl Elem for f32 {}

/// Sizes and offsets of a segment for a world size and lane size.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub world_size: usize,
    pub lane_bytes: usize,
    data_offset: usize,
    pub total_bytes: usize,
}

impl Layout {
    pub fn new(world_size: usize, lane_bytes: usize) -> Result<Self> {
        if world_size == 0 || world_size > MAX_WORLD_SIZE {
            return Err(CommError::InvalidArgument(format!(
                "world_size must be in 1..={MAX_WORLD_SIZE}, got {world_size}"
            )));
        }
        if lane_bytes == 0 || lane_bytes % LANE_ALIGN != 0 || lane_bytes > MAX_LANE_BYTES {
            return Err(CommError::InvalidArgument(format!(
                "lane_bytes must be a positive multiple of {LANE_ALIGN} up to {MAX_LANE_BYTES}, got {lane_bytes}"
            )));
        }
        let data_offset = (GLOBAL_BYTES + SLOT_BYTES * world_size).next_multiple_of(PAGE);
        let total_bytes = data_offset + (2 * world_size + 2) * lane_bytes;
        Ok(Self {
            world_size,
            lane_bytes,
            data_offset,
            total_bytes,
        })
    }

    fn lane_offset(&self, rank: usize, parity: usize) -> usize {
        self.data_offset + (2 * rank + parity) * self.lane_bytes
    }

    fn result_offset(&self, parity: usize) -> usize {
        self.data_offset + (2 * self.world_size + parity) * self.lane_bytes
    }
}

/// One rank's mapping of the segment.
pub struct Segment {
    /// Start of the mapping; valid for `layout.total_bytes` while `_map` lives.
    base: *mut u8,
    _map: MmapMut,
    file: File,
    path: PathBuf,
    pub layout: Layout,
}

// SAFETY: the mapping is plain shared memory; the header is only accessed through atomics and the
// lanes only under the barrier protocol documented on the data accessors.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CommError + '_ {
    move |source| CommError::Io {
        path: path.to_owned(),
        source,
    }
}

impl Segment {
    /// Rank 0: create (replacing any old file at `path`) and initialise the segment.
    pub fn create(path: &Path, layout: Layout) -> Result<Self> {
        let file_name = path.file_name().ok_or_else(|| {
            CommError::InvalidArgument(format!("segment path {} has no file name", path.display()))
        })?;
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let mut tmp_name = file_name.to_owned();
        tmp_name.push(format!(".{}.{nonce}.tmp", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let made = Self::build(&tmp, layout).and_then(|seg| {
            std::fs::rename(&tmp, path).map_err(io_err(path))?;
            Ok(Self {
                path: path.to_owned(),
                ..seg
            })
        });
        if made.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        made
    }

    fn build(tmp: &Path, layout: Layout) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(tmp)
            .map_err(io_err(tmp))?;
        file.set_len(layout.total_bytes as u64)
            .map_err(io_err(tmp))?;
        reserve(&file, layout.total_bytes).map_err(io_err(tmp))?;
        let seg = Self::map(file, tmp, layout)?;
        seg.global(G_VERSION).store(VERSION, Ordering::Relaxed);
        seg.global(G_WORLD)
            .store(layout.world_size as u64, Ordering::Relaxed);
        seg.global(G_LANE)
            .store(layout.lane_bytes as u64, Ordering::Relaxed);
        seg.pid(0)
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        seg.global(G_MAGIC).store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Ranks > 0: open the segment if it is ready. `Ok(None)`: not yet (no file, short file, no
    /// magic, or a stale file whose rank 0 is gone); `Err`: a live segment made for other parameters.
    pub fn try_open(path: &Path, layout: Layout) -> Result<Option<Self>> {
        let file = match OpenOptions::new().read(true).write(true).open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(path)(e)),
        };
        let len = file.metadata().map_err(io_err(path))?.len();
        let header_bytes = Layout::new(1, LANE_ALIGN).expect("valid").data_offset as u64;
        if len < header_bytes {
            return Ok(None);
        }
        // Map only what the header announces; first check what we can see without trusting it.
        let probe = Layout {
            total_bytes: header_bytes as usize,
            ..layout
        };
        let seg = Self::map(file, path, probe)?;
        if seg.global(G_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Ok(None);
        }
        let creator = seg.pid(0).load(Ordering::Relaxed) as u32;
        if seg.departed(0).load(Ordering::Relaxed) != 0 || !pid_alive(creator) {
            return Ok(None); // stale: left over by a finished or crashed job
        }
        let found = (
            seg.global(G_VERSION).load(Ordering::Relaxed),
            seg.global(G_WORLD).load(Ordering::Relaxed),
            seg.global(G_LANE).load(Ordering::Relaxed),
        );
        let wanted = (VERSION, layout.world_size as u64, layout.lane_bytes as u64);
        if found != wanted {
            return Err(CommError::Header {
                path: path.to_owned(),
                detail: format!(
                    "made by pid {creator} for version {}, world_size {}, lane_bytes {}; \
                     this rank wants version {}, world_size {}, lane_bytes {}",
                    found.0, found.1, found.2, wanted.0, wanted.1, wanted.2
                ),
            });
        }
        if len < layout.total_bytes as u64 {
            return Err(CommError::Header {
                path: path.to_owned(),
                detail: format!(
                    "file has {len} bytes, the header implies {}",
                    layout.total_bytes
                ),
            });
        }
        let Segment { file, .. } = seg;
        Self::map(file, path, layout).map(Some)
    }

    fn map(file: File, path: &Path, layout: Layout) -> Result<Self> {
        // SAFETY: the file is ours for the lifetime of the mapping; concurrent modification by the
        // peers is the point, and is only observed through atomics or under the barrier protocol.
        let mut map = unsafe { MmapOptions::new().len(layout.total_bytes).map_mut(&file) }
            .map_err(io_err(path))?;
        let base = map.as_mut_ptr();
        Ok(Self {
            base,
            _map: map,
            file,
            path: path.to_owned(),
            layout,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Remove the file name if it still names this segment (rank 0, once every rank has mapped it).
    pub fn unlink(&self) {
        use std::os::unix::fs::MetadataExt;
        let ours = self.file.metadata().map(|m| (m.dev(), m.ino()));
        let named = std::fs::metadata(&self.path).map(|m| (m.dev(), m.ino()));
        if let (Ok(a), Ok(b)) = (ours, named) {
            if a == b {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }

    fn word(&self, byte_offset: usize) -> &AtomicU64 {
        assert!(byte_offset % 8 == 0 && byte_offset + 8 <= self.layout.total_bytes);
        // SAFETY: in bounds (asserted), 8-byte aligned (the mapping is page aligned), and AtomicU64
        // has the layout of u64; shared-memory words are only ever accessed atomically.
        unsafe { &*(self.base.add(byte_offset) as *const AtomicU64) }
    }

    fn global(&self, word: usize) -> &AtomicU64 {
        self.word(8 * word)
    }

    fn slot(&self, rank: usize, word: usize) -> &AtomicU64 {
        assert!(rank < self.layout.world_size);
        self.word(GLOBAL_BYTES + SLOT_BYTES * rank + 8 * word)
    }

    /// Barrier epoch rank `rank` has reached.
    pub fn arrive(&self, rank: usize) -> &AtomicU64 {
        self.slot(rank, S_ARRIVE)
    }

    /// Pid of rank `rank` (0 until it joins).
    pub fn pid(&self, rank: usize) -> &AtomicU64 {
        self.slot(rank, S_PID)
    }

    /// Non-zero once rank `rank` closed its communicator.
    pub fn departed(&self, rank: usize) -> &AtomicU64 {
        self.slot(rank, S_DEPARTED)
    }

    pub fn write_meta(&self, rank: usize, parity: usize, meta: Meta) {
        let w = S_META + 8 * parity;
        let words = [meta.op, meta.seq, meta.len, meta.root];
        for (i, v) in words.into_iter().enumerate() {
            self.slot(rank, w + i).store(v, Ordering::Relaxed);
        }
    }

    pub fn read_meta(&self, rank: usize, parity: usize) -> Meta {
        let w = S_META + 8 * parity;
        let get = |i| self.slot(rank, w + i).load(Ordering::Relaxed);
        Meta {
            op: get(0),
            seq: get(1),
            len: get(2),
            root: get(3),
        }
    }

    fn region<T: Elem>(&self, offset: usize, range: &Range<usize>) -> *mut T {
        let size = std::mem::size_of::<T>();
        assert!(range.start <= range.end && range.end * size <= self.layout.lane_bytes);
        // SAFETY: in bounds of the region (asserted), which lies inside the mapping.
        unsafe { self.base.add(offset + range.start * size) as *mut T }
    }

    /// Elements `range` of `lane[rank][parity]`.
    ///
    /// # Safety (the barrier protocol)
    /// No rank may write these bytes while the slice lives: the caller reads a lane only between
    /// the barrier that follows its writers' copies and the next barrier of the communicator.
    pub unsafe fn lane<T: Elem>(&self, rank: usize, parity: usize, range: Range<usize>) -> &[T] {
        let ptr = self.region::<T>(self.layout.lane_offset(rank, parity), &range);
        std::slice::from_raw_parts(ptr, range.len())
    }

    /// Elements `range` of this rank's `lane[rank][parity]`, for writing.
    ///
    /// # Safety (the barrier protocol)
    /// Only rank `rank` writes its lane, and only while no peer reads it: after the barrier that
    /// ends the last round of the same parity (see `collectives.rs`).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn lane_mut<T: Elem>(
        &self,
        rank: usize,
        parity: usize,
        range: Range<usize>,
    ) -> &mut [T] {
        let ptr = self.region::<T>(self.layout.lane_offset(rank, parity), &range);
        std::slice::from_raw_parts_mut(ptr, range.len())
    }

    /// Elements `range` of `result[parity]`.
    ///
    /// # Safety
    /// As [`Segment::lane`]: read only after the barrier that follows the owners' writes.
    pub unsafe fn result<T: Elem>(&self, parity: usize, range: Range<usize>) -> &[T] {
        let ptr = self.region::<T>(self.layout.result_offset(parity), &range);
        std::slice::from_raw_parts(ptr, range.len())
    }

    /// Elements `range` of `result[parity]`, for writing.
    ///
    /// # Safety
    /// `range` must be the caller's owned piece (disjoint from every other rank's), written only
    /// between the two barriers of a reduce round.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn result_mut<T: Elem>(&self, parity: usize, range: Range<usize>) -> &mut [T] {
        let ptr = self.region::<T>(self.layout.result_offset(parity), &range);
        std::slice::from_raw_parts_mut(ptr, range.len())
    }
}

/// Allocate the file's blocks now, so a full tmpfs fails here with ENOSPC instead of a SIGBUS on
/// first touch. Filesystems without fallocate keep the sparse file.
fn reserve(file: &File, bytes: usize) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: plain syscall on an fd we own.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, bytes as libc::off_t) };
        if rc != 0 && rc != libc::EOPNOTSUPP && rc != libc::EINVAL {
            return Err(io::Error::from_raw_os_error(rc));
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, bytes);
    Ok(())
}

/// Whether process `pid` exists and is not a zombie (a SIGKILLed child stays a zombie until its
/// parent reaps it, and `kill(pid, 0)` still succeeds on it). Pid 0 means "not joined": alive.
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return true;
    }
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks existence and permission.
    if unsafe { libc::kill(pid, 0) } != 0
        && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the command name, which is in parentheses.
        Ok(stat) => !matches!(
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next()),
            Some('Z' | 'X')
        ),
        Err(e) if e.kind() == io::ErrorKind::NotFound => !Path::new("/proc/self").exists(),
        Err(_) => true,
    }
}
