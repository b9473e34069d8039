//! `kvsched._core.TextStreams`: the engine's text streams (see crate::text).

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::locked;
use crate::error::KvError;
use crate::text;

/// Many requests' streaming text over one tokenizer's table of token bytes:
/// token `t` is `data[offsets[t]:offsets[t + 1]]`; `byte_tokens`: the
/// SentencePiece byte-fallback tokens (`<0xHH>`, one byte each: a run shows
/// each character as it completes, and bytes that cannot be one as one U+FFFD
/// per byte when it ends);
/// `skipped`: the special tokens decode skips (no bytes; a run goes on
/// through them). Raises InvalidConfig on a table that is not one. Each
/// step's tokens for every row in one `push`; text never splits a character,
/// and stop strings end a stream without showing. For tokenizers whose decode
/// is their tokens' bytes joined (kvsched.engine.token_bytes builds and checks
/// the table).
#[pyclass(name = "TextStreams", module = "kvsched._core", frozen)]
pub struct PyTextStreams {
    inner: Mutex<text::TextStreams>,
}

#[pymethods]
impl PyTextStreams {
    #[new]
    #[pyo3(signature = (data, offsets, byte_tokens=Vec::new(), skipped=Vec::new()))]
    fn new(
        data: &Bound<'_, PyBytes>,
        offsets: Vec<usize>,
        byte_tokens: Vec<u32>,
        skipped: Vec<u32>,
    ) -> PyResult<Self> {
        let streams =
            text::TextStreams::new(data.as_bytes().to_vec(), offsets, &byte_tokens, &skipped)?;
        Ok(Self {
            inner: Mutex::new(streams),
        })
    }

    /// Tokens in the table.
    #[getter]
    fn vocab_size(&self) -> PyResult<usize> {
        locked(&self.inner, |s| s.vocab_size())
    }

    fn __len__(&self) -> PyResult<usize> {
        locked(&self.inner, |s| s.len())
    }

    fn __contains__(&self, request_id: u64) -> PyResult<bool> {
        locked(&self.inner, |s| s.contains(request_id))
    }

    /// Open request `request_id`'s stream with its stop strings. Raises
    /// InvalidRequest on an empty stop or a stream it has already.
    #[pyo3(signature = (request_id, stops=Vec::new()))]
    fn add(&self, request_id: u64, stops: Vec<String>) -> PyResult<()> {
        Ok(locked(&self.inner, |s| s.add(request_id, stops))??)
    }

    /// One step: row `i` is request `request_ids[i]` getting `tokens[i]` (a
    /// negative token: one with no text, a stop token); `last[i]`: its final
    /// token (all held text comes out, the stream closes). Returns each row's
    /// text and whether a stop string ended it (its stream closed); a row
    /// whose request has no stream gets "" and False.
    #[pyo3(signature = (request_ids, tokens, last))]
    fn push(
        &self,
        request_ids: Vec<u64>,
        tokens: Vec<i64>,
        last: Vec<bool>,
    ) -> PyResult<(Vec<String>, Vec<bool>)> {
        if tokens.len() != request_ids.len() || last.len() != request_ids.len() {
            return Err(KvError::InvalidRequest(format!(
                "push: {} request ids, {} tokens, {} last flags: one each per row",
                request_ids.len(),
                tokens.len(),
                last.len()
            ))
            .into());
        }
        locked(&self.inner, |s| {
            let mut texts = Vec::with_capacity(request_ids.len());
            let mut stopped = Vec::with_capacity(request_ids.len());
            for ((&id, &t), &end) in request_ids.iter().zip(&tokens).zip(&last) {
                let token = u32::try_from(t).ok();
                let p = s.push(id, token, end).unwrap_or_default();
                texts.push(p.text);
                stopped.push(p.stopped);
            }
            (texts, stopped)
        })
    }

    /// Close a stream whose request ended without a token; returns the text a
    /// possible stop held back (None: no such stream).
    fn finish(&self, request_id: u64) -> PyResult<Option<String>> {
        locked(&self.inner, |s| s.finish(request_id))
    }
}
