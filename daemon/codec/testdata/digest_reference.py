#!/usr/bin/env python3
"""Independent implementation of tensor digests v1 and v2 (docs/ARCHITECTURE.md), from the prose
and format.h only. Prints the rows of digest_golden.txt: python3 digest_reference.py"""
M=(1<<64)-1
def gen(n):
    st=0x5265666974476f6c; out=bytearray()
    while len(out)<n:
        st=(st+0x9E3779B97F4A7C15)&M; z=st
        z=((z^(z>>30))*0xBF58476D1CE4E5B9)&M; z=((z^(z>>27))*0x94D049BB133111EB)&M; z^=z>>31
        out+=z.to_bytes(8,'little')
    return bytes(out[:n])
def words(d):
    p=d+b'\0'*((-len(d))%8)
    return [int.from_bytes(p[i:i+8],'little') for i in range(0,len(p),8)]
def mix(i,w):
    z=((w^(i*0x9E3779B97F4A7C15&M))*0xBF58476D1CE4E5B9)&M
    z=(((z^(z>>32))+(i*0xD6E8FEB86659FD93&M))*0x94D049BB133111EB)&M
    z=((z^(z>>29))*0xFF51AFD7ED558CCD)&M
    return z^(z>>32)
P1,P2,P3,P4,P5=0x9E3779B185EBCA87,0xC2B2AE3D27D4EB4F,0x165667B19E3779F9,0x85EBCA77C2B2AE63,0x27D4EB2F165667C5
def aval(h):
    h^=h>>33; h=h*P2&M; h^=h>>29; h=h*P3&M; h^=h>>32; return h
def v2(d):
    s=sum(mix(i,w) for i,w in enumerate(words(d)))&M
    x=s^aval(len(d)^0x5265666974446732)
    x=((x^(x>>31))*0xC4CEB9FE1A85EC53)&M; x=((x^(x>>29))*0x2545F4914F6CDD1D)&M
    return x^(x>>32)
def rotl(x,r): return ((x<<r)|(x>>(64-r)))&M
def rnd(acc,w): return rotl((acc+w*P2)&M,31)*P1&M
def hash64(d,seed):
    acc=[(seed+P1*(l+1))&M for l in range(256)]
    for i,w in enumerate(words(d)): acc[i%256]=rnd(acc[i%256],w)
    h=seed^(len(d)*P5&M)
    for a in acc: h=((h^rnd(0,a))*P1+P4)&M
    return aval(h)
def v1(d):
    C=1<<20; n=len(d); hs=[hash64(d[o:o+C],c) for c,o in enumerate(range(0,n,C))]
    h=0x5265666974446967^(n*P5&M)
    for c in hs: h=((h^rnd(0,c))*P1+P4)&M
    return aval(h^len(hs))

for n in [0,1,7,8,9,4095,(1<<20)-1,1<<20,(1<<20)+1,3*(1<<20)+5]:
    d=gen(n); print(n,'%016x'%v1(d),'%016x'%v2(d))
