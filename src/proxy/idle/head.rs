//! Where a request's head ends, looked for over the reads that bring it, each byte once.

/// Pingora's largest head (`MAX_HEADER_SIZE`): one this long goes to it as it is, to be refused.
pub const HEAD_LIMIT: usize = 1_048_575;
/// Pingora's most headers (`MAX_HEADERS`) and the request line: past them, the same.
const MAX_HEAD_LINES: usize = 256 + 1;

/// How far a request's head has been looked through, so that each byte is looked at once
/// however many reads the head takes.
#[derive(Debug, Default)]
pub struct HeadScan {
    /// Bytes looked through.
    scanned: usize,
    /// Where the request line starts: past the empty lines a client may send before it, which
    /// Pingora's parser skips.
    start: Option<usize>,
    /// Line feeds from the start.
    lines: usize,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    /// Nothing but empty lines yet.
    Blank,
    Partial,
    /// An empty line after the request line: the head is whole.
    Ends,
    /// More lines than Pingora takes headers, or more bytes than it takes a head: it refuses
    /// the request as it would have.
    PastPingorasLimits,
}

impl HeadScan {
    pub fn look(&mut self, bytes: &[u8]) -> Head {
        let start = match self.start {
            Some(start) => start,
            None => {
                let blank = bytes[self.scanned..]
                    .iter()
                    .take_while(|b| matches!(b, b'\r' | b'\n'))
                    .count();
                self.scanned += blank;
                if self.scanned == bytes.len() {
                    return Head::Blank;
                }
                *self.start.insert(self.scanned)
            }
        };
        // A line end cut between reads: its first bytes are looked at again.
        let from = self.scanned.saturating_sub(2).max(start);
        for at in memchr::memchr_iter(b'\n', &bytes[from..]).map(|i| from + i) {
            if matches!(&bytes[at + 1..], [b'\n', ..] | [b'\r', b'\n', ..]) {
                return Head::Ends;
            }
            if at >= self.scanned {
                self.lines += 1;
            }
        }
        self.scanned = bytes.len();
        if self.lines > MAX_HEAD_LINES || bytes.len() >= HEAD_LIMIT {
            Head::PastPingorasLimits
        } else {
            Head::Partial
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scans `reads` as they would come, one after another.
    fn scan(reads: &[&[u8]]) -> Vec<Head> {
        let (mut scan, mut bytes) = (HeadScan::default(), Vec::new());
        reads
            .iter()
            .map(|read| {
                bytes.extend_from_slice(read);
                scan.look(&bytes)
            })
            .collect()
    }

    #[test]
    fn a_head_ends_at_its_first_empty_line_however_it_is_cut() {
        use Head::*;
        let whole: &[u8] = b"POST / HTTP/1.1\r\nHost: x\r\n\r\n{\"a\":\"\r\n\r\n\"}";
        assert_eq!(scan(&[whole]), [Ends]);
        for cut in 1..whole.len() {
            let (a, b) = whole.split_at(cut);
            let ends_in_a = cut >= 28;
            let want = if ends_in_a { Ends } else { Partial };
            assert_eq!(scan(&[a, b])[..], [want, Ends], "cut at {cut}");
        }
        assert_eq!(scan(&[b"GET / HTTP/1.1\nHost: x\n\nbody"]), [Ends]);
        assert_eq!(scan(&[b"GET / HTTP/1.1\r\nHost: x\r\n\r"]), [Partial]);
        assert_eq!(
            scan(&[b"GET / HTTP/1.1", b"\r\n", b"\r", b"\n"]),
            [Partial, Partial, Partial, Ends]
        );
    }

    #[test]
    fn empty_lines_before_the_request_line_are_not_its_end() {
        use Head::*;
        assert_eq!(scan(&[b"\r\n\r\n", b"\n"]), [Blank, Blank]);
        // Pingora skips them: the head's end is the empty line after the request line.
        assert_eq!(
            scan(&[b"\r\n\r\nPOST / HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"]),
            [Partial, Partial, Ends]
        );
    }

    #[test]
    fn past_pingoras_header_count_the_head_goes_to_it() {
        let mut bytes = b"GET / HTTP/1.1\r\n".to_vec();
        let mut scan = HeadScan::default();
        for i in 0..300 {
            bytes.extend_from_slice(format!("x-{i}: y\r\n").as_bytes());
            if scan.look(&bytes) == Head::PastPingorasLimits {
                assert_eq!(i, MAX_HEAD_LINES - 1);
                return;
            }
        }
        panic!("300 headers read on");
    }
}
