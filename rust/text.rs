//! Streaming text for every request of a step at once: token ids become UTF-8
//! text deltas through a table of each token's bytes, and stop strings are
//! matched on that text.
//!
//! The engine's output processor calls this once per step for all its rows
//! instead of running a Python detokenizer and stop-string matcher per row.
//! It serves tokenizers whose decoding is the concatenation of their tokens'
//! bytes (byte-level BPE, and SentencePiece with byte fallback once `▁` is a
//! space): the Python side builds the table and checks it against the
//! tokenizer's own decode; anything else keeps the per-row Python path.
//!
//! Text never splits a character: bytes that may still be the start of one
//! wait for the next token; bytes that cannot become one are U+FFFD, one per
//! maximal invalid sequence (as `String::from_utf8_lossy` and a byte-level
//! tokenizer's decode write them); a run of SentencePiece byte-fallback tokens
//! shows each character as it completes, and bytes that cannot be one become
//! one U+FFFD per byte when the run ends, as the tokenizers library's
//! ByteFallback decoder writes them (`TokenRole::Byte`; where a run mixes
//! characters and such bytes, the decoder makes the whole run U+FFFDs: the
//! characters shown already stay). Stop strings follow the Python matcher
//! (kvsched/engine/detokenizer.py): text that may be a stop's start waits; the
//! stop that completes first in the stream wins (ties: the longer); the stop
//! itself is never returned.

use std::collections::HashMap;

use crate::error::{KvError, KvResult};

/// What one push produced for a stream.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pushed {
    /// The text that is now final.
    pub text: String,
    /// A stop string matched: the stream ended (and is gone).
    pub stopped: bool,
}

#[derive(Debug)]
struct Stream {
    /// Bytes that may still be the start of a character.
    pending: Vec<u8>,
    /// Byte-fallback tokens' bytes since the last other token (see `TokenRole`).
    run: Vec<u8>,
    /// Text held back because it may be the start of a stop.
    held: String,
    stops: Box<[String]>,
    /// The longest stop's bytes.
    longest: usize,
}

/// Many requests' text streams over one tokenizer's table of token bytes.
#[derive(Debug)]
pub struct TextStreams {
    bytes: Vec<u8>,
    /// Token `t`'s bytes are `bytes[offsets[t]..offsets[t + 1]]`.
    offsets: Vec<usize>,
    roles: Vec<TokenRole>,
    streams: HashMap<u64, Stream>,
}

/// How a token's bytes join the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenRole {
    /// Its bytes follow the text's.
    Text,
    /// A SentencePiece byte-fallback token (`<0xHH>`): a run of them shows
    /// each character as its last byte comes; bytes that cannot be one are
    /// one U+FFFD per byte when the run ends (another token, or the end).
    Byte,
    /// A special token its decode skips: no text, and a byte run goes on
    /// through it.
    Skipped,
}

impl TextStreams {
    /// A table of `offsets.len() - 1` tokens: token `t` is
    /// `bytes[offsets[t]..offsets[t + 1]]` (offsets start at 0, never decrease
    /// and end at `bytes.len()`).
    /// `byte_tokens` and `skipped`: the tokens whose role is `TokenRole::Byte`
    /// (each must be one byte) and `TokenRole::Skipped` (no bytes).
    pub fn new(
        bytes: Vec<u8>,
        offsets: Vec<usize>,
        byte_tokens: &[u32],
        skipped: &[u32],
    ) -> KvResult<Self> {
        let ordered = offsets.windows(2).all(|w| w[0] <= w[1]);
        if offsets.first() != Some(&0) || offsets.last() != Some(&bytes.len()) || !ordered {
            return Err(KvError::InvalidConfig(
                "token table: offsets must start at 0, never decrease and end at the \
                 length of the bytes"
                    .into(),
            ));
        }
        let n = offsets.len() - 1;
        let mut roles = vec![TokenRole::Text; n];
        for (ids, role, len) in [
            (byte_tokens, TokenRole::Byte, 1),
            (skipped, TokenRole::Skipped, 0),
        ] {
            for &t in ids {
                let t = t as usize;
                if t >= n || offsets[t + 1] - offsets[t] != len || roles[t] != TokenRole::Text {
                    return Err(KvError::InvalidConfig(format!(
                        "token table: token {t} cannot be {role:?} (out of the table, \
                         {len} bytes needed, or named twice)"
                    )));
                }
                roles[t] = role;
            }
        }
        Ok(Self {
            bytes,
            offsets,
            roles,
            streams: HashMap::new(),
        })
    }

    /// Tokens in the table.
    pub fn vocab_size(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Streams open.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.streams.contains_key(&id)
    }

    /// Open a stream for request `id` with its stop strings (none: text only).
    pub fn add(&mut self, id: u64, stops: Vec<String>) -> KvResult<()> {
        if stops.iter().any(String::is_empty) {
            return Err(KvError::InvalidRequest(
                "stop strings must be non-empty".into(),
            ));
        }
        if self.streams.contains_key(&id) {
            return Err(KvError::InvalidRequest(format!(
                "request {id} has a text stream already"
            )));
        }
        let mut unique: Vec<String> = Vec::with_capacity(stops.len());
        for s in stops {
            if !unique.contains(&s) {
                unique.push(s);
            }
        }
        let longest = unique.iter().map(String::len).max().unwrap_or(0);
        let stream = Stream {
            pending: Vec::new(),
            run: Vec::new(),
            held: String::new(),
            stops: unique.into(),
            longest,
        };
        self.streams.insert(id, stream);
        Ok(())
    }

    /// Request `id` got `token` (None: a token with no text, a stop token);
    /// `last`: its final token, so everything held is emitted and the stream
    /// closes. None when `id` has no stream. A token outside the table has
    /// no text (as a tokenizer's decode skips ids it does not know).
    pub fn push(&mut self, id: u64, token: Option<u32>, last: bool) -> Option<Pushed> {
        let stream = self.streams.get_mut(&id)?;
        if let Some(t) = token {
            let t = t as usize;
            if t + 1 < self.offsets.len() {
                let bytes = &self.bytes[self.offsets[t]..self.offsets[t + 1]];
                match self.roles[t] {
                    TokenRole::Text => {
                        end_run(stream);
                        stream.pending.extend_from_slice(bytes);
                    }
                    TokenRole::Byte => {
                        stream.run.extend_from_slice(bytes);
                        take_complete_run(stream);
                    }
                    TokenRole::Skipped => {}
                }
            }
        }
        if last {
            end_run(stream);
        }
        let text = take_text(&mut stream.pending, last);
        let (text, stopped) = stream.match_stops(text, last);
        if stopped || last {
            self.streams.remove(&id);
        }
        Some(Pushed { text, stopped })
    }

    /// Close request `id`'s stream when it ended without a token: the text a
    /// possible stop held back (bytes of an unfinished character are dropped).
    /// None when it has no stream.
    pub fn finish(&mut self, id: u64) -> Option<String> {
        self.streams.remove(&id).map(|s| s.held)
    }
}

/// The characters a byte-fallback run has completed so far join `pending`
/// at once (as the per-request Python detokenizer shows them), so a stop
/// string in them ends the request on the same token either way. Only an
/// unfinished character stays in the run; once the run holds bytes that
/// cannot be one, it waits for its end.
fn take_complete_run(stream: &mut Stream) {
    let valid = match std::str::from_utf8(&stream.run) {
        Ok(_) => stream.run.len(),
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        Err(_) => return,
    };
    stream.pending.extend(stream.run.drain(..valid));
}

/// A run of byte-fallback tokens ends: its text joins `pending`.
fn end_run(stream: &mut Stream) {
    if stream.run.is_empty() {
        return;
    }
    if std::str::from_utf8(&stream.run).is_ok() {
        stream.pending.append(&mut stream.run);
    } else {
        for _ in 0..stream.run.len() {
            stream.pending.extend_from_slice("\u{FFFD}".as_bytes());
        }
        stream.run.clear();
    }
}

/// The final text at the front of `pending` (all of it when `last`): every
/// complete character, U+FFFD for each maximal sequence that cannot be one,
/// and an incomplete character at the end left in `pending`.
fn take_text(pending: &mut Vec<u8>, last: bool) -> String {
    if last {
        let text = String::from_utf8_lossy(pending).into_owned();
        pending.clear();
        return text;
    }
    let mut text = String::new();
    let mut start = 0;
    while start < pending.len() {
        match std::str::from_utf8(&pending[start..]) {
            Ok(s) => {
                text.push_str(s);
                start = pending.len();
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // from_utf8 found these bytes valid: this never fails.
                text.push_str(std::str::from_utf8(&pending[start..start + valid]).unwrap_or(""));
                match e.error_len() {
                    Some(n) => {
                        text.push(char::REPLACEMENT_CHARACTER);
                        start += valid + n;
                    }
                    None => {
                        start += valid; // the start of a character: wait for its rest
                        break;
                    }
                }
            }
        }
    }
    pending.drain(..start);
    text
}

impl Stream {
    /// `delta` through the stop strings: (the text to emit, whether one matched).
    fn match_stops(&mut self, delta: String, last: bool) -> (String, bool) {
        if self.stops.is_empty() {
            return (delta, false);
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(&delta);
        // The stop that completes first; ties: the longer one.
        let mut best: Option<(usize, usize)> = None; // (end, start)
        for s in self.stops.iter() {
            if let Some(i) = buf.find(s.as_str()) {
                let cand = (i + s.len(), i);
                if best.is_none_or(|b| cand < b) {
                    best = Some(cand);
                }
            }
        }
        if let Some((_, start)) = best {
            buf.truncate(start);
            return (buf, true);
        }
        if last {
            return (buf, false);
        }
        let hold = self.partial_len(&buf);
        self.held = buf.split_off(buf.len() - hold);
        (buf, false)
    }

    /// Bytes in the longest suffix of `buf` that is a proper prefix of a stop.
    fn partial_len(&self, buf: &str) -> usize {
        let mut best = 0;
        for (i, _) in buf.char_indices().rev() {
            let tail = &buf[i..];
            if tail.len() >= self.longest {
                break;
            }
            if self
                .stops
                .iter()
                .any(|s| s.len() > tail.len() && s.starts_with(tail))
            {
                best = tail.len();
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams over a table of each token's bytes, with its byte-fallback
    /// and skipped tokens.
    fn streams_with(tokens: &[&[u8]], byte_tokens: &[u32], skipped: &[u32]) -> TextStreams {
        let mut bytes = Vec::new();
        let mut offsets = vec![0];
        for t in tokens {
            bytes.extend_from_slice(t);
            offsets.push(bytes.len());
        }
        TextStreams::new(bytes, offsets, byte_tokens, skipped).unwrap()
    }

    fn streams(tokens: &[&[u8]]) -> TextStreams {
        streams_with(tokens, &[], &[])
    }

    fn run(s: &mut TextStreams, id: u64, tokens: &[u32]) -> (String, bool) {
        let mut out = String::new();
        for (i, &t) in tokens.iter().enumerate() {
            let p = s.push(id, Some(t), i + 1 == tokens.len()).unwrap();
            out.push_str(&p.text);
            if p.stopped {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn a_character_split_over_tokens_waits_for_its_last_byte() {
        // "€" is E2 82 AC.
        let mut s = streams(&[b"a", b"\xe2", b"\x82", b"\xac", b" b"]);
        s.add(1, vec![]).unwrap();
        assert_eq!(s.push(1, Some(0), false).unwrap().text, "a");
        assert_eq!(s.push(1, Some(1), false).unwrap().text, "");
        assert_eq!(s.push(1, Some(2), false).unwrap().text, "");
        assert_eq!(s.push(1, Some(3), false).unwrap().text, "€");
        assert_eq!(s.push(1, Some(4), true).unwrap().text, " b");
        assert!(s.is_empty(), "the last push closes the stream");
    }

    #[test]
    fn invalid_bytes_are_one_replacement_each_maximal_sequence_as_lossy_decoding() {
        let tokens: &[&[u8]] = &[b"\xe2\x82", b"x", b"\xff", b"\xe2", b"y", b"\xf0\x9f"];
        let mut s = streams(tokens);
        s.add(7, vec![]).unwrap();
        let (text, _) = run(&mut s, 7, &[0, 1, 2, 3, 4, 5]);
        let all: Vec<u8> = tokens.concat();
        assert_eq!(text, String::from_utf8_lossy(&all));
    }

    #[test]
    fn a_byte_fallback_run_shows_characters_as_they_complete() {
        // Tokens: 0 "x", 1 <0xE2>, 2 <0x82>, 3 <0xAC>, 4 <0x41> ("A"), 5 a skipped special.
        let tokens: &[&[u8]] = &[b"x", b"\xe2", b"\x82", b"\xac", b"A", b""];
        let mut s = streams_with(tokens, &[1, 2, 3, 4], &[5]);
        s.add(1, vec![]).unwrap();
        // A valid run, a special token inside it: "€".
        assert_eq!(run(&mut s, 1, &[1, 5, 2, 3, 0]), ("€x".into(), false));
        // "A" shows at once; an unfinished character cut by another token:
        // one U+FFFD per byte.
        s.add(2, vec![]).unwrap();
        assert_eq!(
            s.push(2, Some(4), false).unwrap().text,
            "A",
            "a character shows at once"
        );
        assert_eq!(
            s.push(2, Some(1), false).unwrap().text,
            "",
            "half a character waits"
        );
        assert_eq!(s.push(2, Some(2), false).unwrap().text, "");
        assert_eq!(s.push(2, Some(0), true).unwrap().text, "\u{FFFD}\u{FFFD}x");
        // A stop in a run's characters ends the stream on that token.
        s.add(3, vec!["A".into()]).unwrap();
        assert_eq!(
            s.push(3, Some(0), false).unwrap(),
            Pushed {
                text: "x".into(),
                stopped: false
            }
        );
        assert_eq!(
            s.push(3, Some(4), false).unwrap(),
            Pushed {
                text: String::new(),
                stopped: true
            }
        );
        // Bytes that can never be a character make the rest of the run wait for its end.
        s.add(4, vec![]).unwrap();
        assert_eq!(
            s.push(4, Some(3), false).unwrap().text,
            "",
            "a lone continuation byte"
        );
        assert_eq!(s.push(4, Some(4), false).unwrap().text, "");
        assert_eq!(
            s.push(4, Some(4), true).unwrap().text,
            "\u{FFFD}\u{FFFD}\u{FFFD}"
        );
    }

    #[test]
    fn a_stop_string_ends_the_stream_and_never_shows() {
        let mut s = streams(&[b"Hello", b" wor", b"ld", b"\n", b"\nmore"]);
        s.add(3, vec!["\n\n".into()]).unwrap();
        assert_eq!(
            s.push(3, Some(0), false).unwrap(),
            Pushed {
                text: "Hello".into(),
                stopped: false
            }
        );
        assert_eq!(
            s.push(3, Some(3), false).unwrap().text,
            "",
            "a possible stop start waits"
        );
        let p = s.push(3, Some(4), false).unwrap();
        assert_eq!(
            p,
            Pushed {
                text: String::new(),
                stopped: true
            }
        );
        assert!(!s.contains(3));
        assert_eq!(s.push(3, Some(0), false), None);
    }

    #[test]
    fn held_text_comes_out_when_it_is_not_a_stop_or_the_stream_ends() {
        let mut s = streams(&[b"ab", b"x", b"a"]);
        s.add(1, vec!["abc".into()]).unwrap();
        assert_eq!(s.push(1, Some(0), false).unwrap().text, "");
        assert_eq!(s.push(1, Some(1), false).unwrap().text, "abx");
        assert_eq!(
            s.push(1, Some(2), true).unwrap().text,
            "a",
            "the end flushes it"
        );
        s.add(2, vec!["abc".into()]).unwrap();
        s.push(2, Some(0), false);
        assert_eq!(
            s.finish(2).as_deref(),
            Some("ab"),
            "an ending without a token too"
        );
    }

    #[test]
    fn the_stop_that_completes_first_wins_ties_the_longer() {
        let mut s = streams(&[b"xabcd"]);
        s.add(1, vec!["cd".into(), "abc".into()]).unwrap();
        assert_eq!(s.push(1, Some(0), false).unwrap().text, "x");
        s.add(2, vec!["bc".into(), "abc".into()]).unwrap();
        assert_eq!(
            s.push(2, Some(0), false).unwrap().text,
            "x",
            "same end: abc, the longer"
        );
    }

    #[test]
    fn a_token_with_no_text_and_unknown_ids_add_nothing() {
        let mut s = streams(&[b"a"]);
        s.add(1, vec![]).unwrap();
        assert_eq!(s.push(1, None, false).unwrap().text, "");
        assert_eq!(s.push(1, Some(99), false).unwrap().text, "");
        assert_eq!(s.push(2, Some(0), false), None, "no stream: None");
    }

    #[test]
    fn bad_tables_and_stops_are_refused() {
        assert!(TextStreams::new(b"ab".to_vec(), vec![0, 3], &[], &[]).is_err());
        assert!(TextStreams::new(b"ab".to_vec(), vec![0, 2, 1, 2], &[], &[]).is_err());
        assert!(TextStreams::new(vec![], vec![], &[], &[]).is_err());
        let two = || (b"ab".to_vec(), vec![0, 2, 2]);
        let (b, o) = two();
        assert!(
            TextStreams::new(b, o, &[0], &[]).is_err(),
            "a byte token of two bytes"
        );
        let (b, o) = two();
        assert!(
            TextStreams::new(b, o, &[], &[0]).is_err(),
            "a skipped token with bytes"
        );
        let (b, o) = two();
        assert!(TextStreams::new(b, o, &[], &[1, 1]).is_err(), "named twice");
        let (b, o) = two();
        assert!(
            TextStreams::new(b, o, &[], &[2]).is_err(),
            "out of the table"
        );
        let mut s = streams(&[b"a"]);
        assert!(s.add(1, vec![String::new()]).is_err());
        s.add(1, vec![]).unwrap();
        assert!(s.add(1, vec![]).is_err(), "one stream per request");
    }
}
