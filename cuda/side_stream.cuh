/* ops.h side_begin / side_mark / side_end / side_wait: a second stream that the backend's ops
 * queue on between side_begin and side_end (g_cuda.stream is switched to it, so every op and its
 * profile wrapper follow), ordered against the compute stream by events. */
#ifndef MT_CUDA_SIDE_STREAM_CUH
#define MT_CUDA_SIDE_STREAM_CUH

void cu_side_begin(void);
void cu_side_mark(int i);
void cu_side_end(void);
void cu_side_wait(int i);
/* the priority context_init creates the compute stream with (MT_SIDE_PRIORITY) */
int cu_compute_stream_priority(void);

#endif
